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

Fold: ep divides the T = dp x fsdp x cp ranks that hold different tokens (cp innermost, then
fsdp, then dp: Megatron-Core's fold over data and context ranks); the T/ep ranks holding the
same experts are the "expert data-parallel" group.

Gradients: an expert's gradient on its owner is the sum of the terms of the tokens of every
ep rank; summed over the expert data group it holds every token rank's terms, and divided by
the D = dp x fsdp data ranks it is the mean over samples (a cp rank's loss already weighs its
sequence shard by the whole sequence's token count) -- `ExpertParallel.sync_gradients`. The
router and every other parameter are replicated, summed over cp and averaged over the data
ranks as usual; the expert parameters must be left out of both (`expert_names`). In the global
gradient norm an expert parameter is held by world/ep ranks instead of world (its share times
ep).

With FSDP (fsdp > 1, torchtitan's layout) the dense parameters are sharded over the data
ranks as usual, and each MoE layer's experts are an FSDP2 unit of their own over the expert
data group (`ExpertParallel.shard`: a 1-D mesh of those T/ep ranks): its reduce-scatter
averages over them and `sync_gradients` rescales to the sum over D (FSDP's own divide factor
is a PREMUL_SUM, which gloo lacks). Experts no token reached reduce zeros, so the scatters
match on every rank. Where ep = T (no other rank holds the same experts) the experts are left
out of FSDP and divided by D after the backward, as without FSDP.

Public functions:
    expert_owner(expert, num_experts, ep) -> rank
    is_moe_block(module) -> bool                  # what apply_expert_parallel shares out
    apply_expert_parallel(model, groups, num_data_ranks=None, required=True) -> ExpertParallel
    ExpertParallel.expert_parameters(model) -> list of parameters (this rank's experts)
    ExpertParallel.is_expert(name) -> bool
    ExpertParallel.shard(reshard, mp_policy) -> parameters FSDP must ignore  # fsdp > 1
    ExpertParallel.sync_gradients(model)          # after backward: experts' data average
    build_expert_groups(world, tokens, inner, ep, ranks=None, device_type) -> ExpertGroups
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autopar.runtime.collectives import TokenExchange, all_reduce_flat
from autopar.runtime.hf_experts import is_hf_experts, shard_hf_experts
from autopar.runtime.mesh import device_mesh


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


class ExpertGroups(NamedTuple):
    """This rank's expert-parallel groups (`build_expert_groups`)."""

    ep: dist.ProcessGroup  # the ranks sharing the experts out
    data: dist.ProcessGroup | None  # the ranks holding the same experts (None: this one only)
    data_mesh: DeviceMesh | None  # the same ranks as a 1-D mesh: FSDP2 of the experts


@dataclass
class ExpertParallel:
    """A model under expert parallelism and what the training loop calls (module docstring)."""

    groups: ExpertGroups
    size: int
    rank: int
    num_data_ranks: int
    expert_names: frozenset[str]
    num_blocks: int
    # per MoE block the modules holding this rank's experts (a MoEBlock's local experts, an
    # HF expert stack): one FSDP2 unit each under fsdp
    modules: tuple[tuple[nn.Module, ...], ...] = field(default=(), repr=False, compare=False)
    sharded: bool = False  # FSDP2 units over the expert data group reduce their gradients
    # the expert names every ep rank shares while holding its own slice (transformers' stacks;
    # the zoo's experts are named by their global index): what a checkpoint must tell apart
    stacked_names: frozenset[str] = frozenset()

    def is_expert(self, name: str) -> bool:
        return name in self.expert_names

    def expert_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if n in self.expert_names]

    def shard(
        self, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy
    ) -> set[nn.Parameter]:
        """fsdp > 1: each block's expert modules one FSDP2 unit over the expert data group
        (module docstring). Returns the parameters the surrounding units must ignore: every
        expert's where no other rank holds the same experts (`sync_gradients` divides them)."""
        if self.groups.data_mesh is None:
            return {p for unit in self.modules for m in unit for p in m.parameters()}
        for unit in self.modules:  # a list of modules is one FSDP2 unit (one gather)
            fully_shard(
                list(unit),
                mesh=self.groups.data_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
            )
            for module in unit:  # an expert no token reached: zeros, so the scatters match
                module.set_reduce_scatter_unused_params(True)
        self.sharded = True
        return set()

    def sync_gradients(self, model: nn.Module) -> None:
        """Experts' gradients: sum over the expert data group, divide by the data ranks (FSDP
        units have averaged over the group, module docstring). An expert no token reached on
        this rank has no gradient: zeros, so every rank of the group reduces the same
        tensors."""
        params = self.expert_parameters(model)
        if self.sharded:  # averaged over the group: sum / its size; sum / data ranks wanted
            replicas = dist.get_world_size(self.groups.data)
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(replicas / self.num_data_ranks)
            return
        for p in params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        all_reduce_flat(grads, self.groups.data, divide_by=self.num_data_ranks)

    def as_text(self) -> str:
        how = "FSDP2 over their replicas" if self.sharded else "summed over their replicas"
        return (
            f"expert parallel over ep={self.size}: {self.num_blocks} MoE blocks, "
            f"{len(self.expert_names)} expert parameters on this rank ({how}), all-to-all "
            "dispatch"
        )


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE block this module can share out: a router's token
    ``dispatch`` and an ``experts`` list (`autopar.models.moe.MoEBlock`), or a Hugging Face
    expert stack (`autopar.runtime.hf_experts`)."""
    return (hasattr(module, "dispatch") and hasattr(module, "experts")) or is_hf_experts(module)


def apply_expert_parallel(
    model: nn.Module,
    groups: ExpertGroups,
    num_data_ranks: int | None = None,
    required: bool = True,
) -> ExpertParallel:
    """Keep this rank's experts in every MoE block and dispatch by all-to-all (in place).

    Args:
        model: holds `MoEBlock`s (modules with `experts`, `num_experts`, `dispatch`) or
            Hugging Face expert stacks.
        groups: this rank's ep group (data-parallel ranks that share the experts out) and
            expert data group (`build_expert_groups`).
        num_data_ranks: ranks that see different samples (default: ep times the size of
            the expert data group).
        required: whether ``model`` must hold an MoE block (False for a pipeline chunk: a
            chunk of DeepSeek-V3's dense first layers has none).

    Raises:
        ValueError: no MoE block, or ep does not divide a block's number of experts.
    """
    ep_group = groups.ep
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    edp = dist.get_world_size(groups.data) if groups.data is not None else 1
    names: set[str] = set()
    stacked: set[str] = set()
    holders: list[tuple[nn.Module, ...]] = []
    for path, module in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        if is_hf_experts(module):  # transformers' stacked experts: sliced under their names
            stacked.update(prefix + n for n in shard_hf_experts(module, ep_group))
            holders.append((module,))
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
        holders.append(tuple(module.experts.values()))
    if not holders and required:
        raise ValueError(f"expert parallelism: {type(model).__name__} has no MoE block")
    data_ranks = num_data_ranks or ep * edp
    return ExpertParallel(
        groups,
        ep,
        rank,
        data_ranks,
        frozenset(names | stacked),
        len(holders),
        tuple(holders),
        stacked_names=frozenset(stacked),
    )


def build_expert_groups(
    world: int,
    tokens: int,
    inner: int,
    ep: int,
    ranks: torch.Tensor | None = None,
    device_type: str = "cpu",
) -> ExpertGroups:
    """This rank's expert groups, ep folded over the ranks that hold different tokens (dp x
    fsdp x cp, cp innermost: Megatron-Core's fold over data and context ranks).

    ``ranks``: the mesh's ranks indexed [pp, dp, fsdp, cp, tp] (`RuntimeMesh.mesh.mesh`, laid
    out in the plan's axis order); default `arange(world)` as [pp, tokens, inner] (inner = tp,
    the default order). The token index splits into (tokens/ep, ep), ep inner, so rank 0's ep
    group is the ep token ranks nearest it (`autopar.estimate.mesh.expert_ranks`). Every rank
    must call this (the mesh's groups are made collectively).

    Raises:
        ValueError: ep does not divide the token ranks.
    """
    if tokens % ep:
        raise ValueError(
            f"expert parallelism folds over the dp x fsdp x cp ranks: ep={ep} must divide {tokens}"
        )
    base = torch.arange(world) if ranks is None else ranks
    layout = base.reshape(-1, tokens // ep, ep, inner)
    # one mesh over the world: its "ep" and "edp" groups, and "edp" as FSDP2's mesh
    mesh = device_mesh(device_type, layout, ("pp", "edp", "ep", "inner"))
    replicas = tokens > ep
    return ExpertGroups(
        mesh.get_group("ep"),
        mesh.get_group("edp") if replicas else None,
        mesh["edp"] if replicas else None,
    )
