"""Expert parallelism: each of the ep ranks keeps num_experts/ep experts; tokens travel to them.

In: a model with `MoEBlock`s (`autopar.models.moe`: a router, `experts`, a `dispatch` hook)
or Hugging Face expert stacks (`autopar.runtime.hf_experts`, which shares those out) and the
"ep" process group. Out: every MoE block keeps only this rank's experts (an
`nn.ModuleDict` keyed by the expert's original index, so parameter names stay
`...experts.<e>....`) and dispatches by all-to-all; an `ExpertParallel` record says which
parameters are experts and syncs their gradients.

Ownership: ep rank r owns experts [r*E/ep, (r+1)*E/ep).

Dispatch of one block, on every ep rank (T local tokens, w_TE the router's combine weights,
zero outside each token's top k):
    pairs (e, t) with w[t, e] != 0, sorted by expert then token; rows x[t] in that order
    counts per expert all-to-all'ed (each owner learns how many rows each rank sends it)
    rows all-to-all'ed to their experts' owners (`collectives.all_to_all`, autograd-correct)
    each local expert runs on its received rows
    results all-to-all'ed back (the inverse splits)
    out[t] = sum over the token's pairs, in expert order, of w[t, e] * y   (index_add)
The dense block computes out = sum_e w[:, e] * expert_e(x) in expert order with zeros for the
unrouted experts, so both sums add the same terms in the same order: equal up to the matmul's
rounding on different row counts.

Gradients: an expert's gradient on its owner is the sum of the terms of the tokens of every
ep rank; the ep ranks are data-parallel ranks (ep divides dp here), so with D data ranks the
owner divides by D after summing over the ranks that hold the same expert (the "expert
data-parallel" group, D/ep of them) -- `ExpertParallel.sync_gradients`. The router and every
other parameter are replicated and averaged over the data ranks as usual; the expert
parameters must be left out of that average (`expert_parameters`). In the global gradient
norm an expert parameter is held by world/ep ranks instead of world (its share times ep).

Public functions:
    expert_owner(expert, num_experts, ep) -> rank
    is_moe_block(module) -> bool                  # what apply_expert_parallel shares out
    apply_expert_parallel(model, ep_group, expert_data_group=None) -> ExpertParallel
    ExpertParallel.expert_parameters(model) -> list of parameters (this rank's experts)
    ExpertParallel.is_expert(name) -> bool
    ExpertParallel.sync_gradients(model)          # after backward: experts' data average
    build_expert_groups(world, dp, inner, ep, ranks=None) -> (ep group, expert data group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.collectives import TokenExchange, all_reduce_flat
from autopar.runtime.hf_experts import is_hf_experts, shard_hf_experts


def expert_owner(expert: int, num_experts: int, ep: int) -> int:
    """The ep rank that keeps ``expert`` (contiguous blocks of num_experts/ep)."""
    return expert // (num_experts // ep)


class AllToAllDispatch:
    """The `MoEBlock.dispatch` hook under expert parallelism (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group, self.num_experts = group, num_experts
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.per_rank = num_experts // self.ep

    def __call__(self, x_TH: torch.Tensor, w_TE: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        e_P, t_P = (w_TE.detach() != 0).T.nonzero(as_tuple=True)  # sorted by expert, token
        exchange = TokenExchange(e_P, self.num_experts, self.group)
        rows = exchange.dispatch(x_TH.index_select(0, t_P))
        y = torch.zeros_like(rows)  # each local expert runs on its own received rows
        for j in range(self.per_rank):
            idx = (exchange.local_R == j).nonzero(as_tuple=True)[0]
            expert = experts[str(self.rank * self.per_rank + j)]
            y = y.index_copy(0, idx, expert(rows.index_select(0, idx)))
        back = exchange.combine(y)
        weighted = w_TE[t_P, e_P].unsqueeze(-1) * back
        return torch.zeros_like(x_TH).index_add(0, t_P, weighted)


@dataclass
class ExpertParallel:
    """A model under expert parallelism and what the training loop calls (module docstring)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    expert_data_group: dist.ProcessGroup | None
    num_data_ranks: int
    expert_names: frozenset[str]
    num_blocks: int

    def is_expert(self, name: str) -> bool:
        return name in self.expert_names

    def expert_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if n in self.expert_names]

    def sync_gradients(self, model: nn.Module) -> None:
        """Experts' gradients: sum over the expert data group, divide by the data ranks. An
        expert no token reached on this rank has no gradient: zeros, so every rank of the
        group reduces the same tensors."""
        params = self.expert_parameters(model)
        for p in params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        all_reduce_flat(grads, self.expert_data_group, divide_by=self.num_data_ranks)

    def as_text(self) -> str:
        return (
            f"expert parallel over ep={self.size}: {self.num_blocks} MoE blocks, "
            f"{len(self.expert_names)} expert parameters on this rank, all-to-all dispatch"
        )


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE block this module can share out: a router's token
    ``dispatch`` and an ``experts`` list (`autopar.models.moe.MoEBlock`), or a Hugging Face
    expert stack (`autopar.runtime.hf_experts`)."""
    return (hasattr(module, "dispatch") and hasattr(module, "experts")) or is_hf_experts(module)


def apply_expert_parallel(
    model: nn.Module,
    ep_group: dist.ProcessGroup,
    expert_data_group: dist.ProcessGroup | None = None,
    num_data_ranks: int | None = None,
    required: bool = True,
) -> ExpertParallel:
    """Keep this rank's experts in every MoE block and dispatch by all-to-all (in place).

    Args:
        model: holds `MoEBlock`s (modules with `experts`, `num_experts`, `dispatch`).
        ep_group: the ep ranks (data-parallel ranks that share the experts out).
        expert_data_group: the ranks holding the same experts (None: ep covers every data
            rank).
        num_data_ranks: ranks that see different samples (default: ep times the size of
            ``expert_data_group``).
        required: whether ``model`` must hold an MoE block (False for a pipeline chunk: a
            chunk of DeepSeek-V3's dense first layers has none).

    Raises:
        ValueError: no MoE block, or ep does not divide a block's number of experts.
    """
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    edp = dist.get_world_size(expert_data_group) if expert_data_group is not None else 1
    names: set[str] = set()
    blocks = 0
    for path, module in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        if is_hf_experts(module):  # transformers' stacked experts: sliced under their names
            names.update(prefix + n for n in shard_hf_experts(module, ep_group))
            blocks += 1
            continue
        if not is_moe_block(module):
            continue
        num_experts = module.num_experts
        if num_experts % ep:
            raise ValueError(
                f"expert parallelism: ep={ep} does not divide the {num_experts} experts of {path}"
            )
        per_rank = num_experts // ep
        keep = range(rank * per_rank, (rank + 1) * per_rank)
        module.experts = nn.ModuleDict({str(e): module.experts[e] for e in keep})
        module.dispatch = AllToAllDispatch(ep_group, num_experts)
        names.update(f"{prefix}experts.{n}" for n, _ in module.experts.named_parameters())
        blocks += 1
    if not blocks and required:
        raise ValueError(f"expert parallelism: {type(model).__name__} has no MoE block")
    return ExpertParallel(
        ep_group, ep, rank, expert_data_group, num_data_ranks or ep * edp, frozenset(names), blocks
    )


def build_expert_groups(
    world: int, dp: int, inner: int, ep: int, ranks: torch.Tensor | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's ep group and expert data group, for ep folded over the dp axis.

    ``ranks``: the mesh's ranks indexed [pp, dp, fsdp, cp, tp] (`RuntimeMesh.mesh.mesh`, laid
    out in the plan's axis order); default `arange(world)` as [pp, dp, inner] (inner =
    fsdp*cp*tp, the default order). The dp index splits into (dp/ep, ep), ep inner, so rank 0's
    ep group is the ep ranks along dp nearest it (`autopar.estimate.mesh.expert_ranks`). Every
    rank must call this (new_group is collective). Returns (ep group, expert data group or None
    when dp == ep).

    Raises:
        ValueError: ep does not divide dp.
    """
    if dp % ep:
        raise ValueError(f"expert parallelism folds over dp here: ep={ep} must divide dp={dp}")
    base = torch.arange(world) if ranks is None else ranks
    layout = base.reshape(-1, dp // ep, ep, inner)
    me = dist.get_rank()
    ep_group = edp_group = None
    for ranks in layout.permute(0, 1, 3, 2).reshape(-1, ep).tolist():
        group = dist.new_group(ranks)
        if me in ranks:
            ep_group = group
    if dp > ep:
        for ranks in layout.permute(0, 2, 3, 1).reshape(-1, dp // ep).tolist():
            group = dist.new_group(ranks)
            if me in ranks:
                edp_group = group
    assert ep_group is not None
    return ep_group, edp_group
