"""Expert parallelism over Hugging Face's expert modules: each ep rank keeps num_experts/ep of
them, and tokens travel to their experts by all-to-all.

transformers (5.x) stores a MoE layer's experts as one module (`MixtralExperts`,
`Qwen3MoeExperts`, `DeepseekV3Experts` and some sixty more) whose parameters stack the experts
on their first dimension (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], biases [E, ...])
and whose forward is `forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
-> [T, H]`, the weighted sum of each token's k experts. The router and shared experts live in
the surrounding block and stay replicated.

Under ep, on every ep rank (ownership as `expert_parallel.expert_owner`: contiguous blocks):
    the module's parameters keep only this rank's experts, rows [r*E/ep, (r+1)*E/ep), under
    their original names (`ExpertParallel.expert_names` lists them: synced over the expert
    data group, left out of the data-parallel average)
    pairs (token, slot) sorted by expert (stable: tokens in order), rows x[t] all-to-all'ed to
    their experts' owners with the per-expert counts
    the module's own forward runs on the received rows, each with one expert (its local
    index) and weight 1: whatever the family's expert math and `experts_implementation`
    (eager loop, grouped_mm), it is the model's own code that computes the experts
    results all-to-all'ed back, multiplied by the routing weight at the token's rank (so the
    router's gradient stays local) and summed per token in expert order (index_add): the
    order the dense forward adds them in
Pairs routed to index E (families that mark a dropped slot so) are skipped, as the dense
forward skips them.

Public:
    is_hf_experts(module) -> bool
    shard_hf_experts(module, group) -> names of the parameters it now holds a part of
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.collectives import TokenExchange


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face expert stack this module can share out (module
    docstring): ``num_experts``, 3-D ``gate_up_proj`` and ``down_proj`` whose first dimension
    is the experts (every other own parameter too), and the three-argument forward."""
    num = getattr(module, "num_experts", None)
    own = dict(module.named_parameters(recurse=False))
    if not isinstance(num, int) or num < 1 or not {"gate_up_proj", "down_proj"} <= own.keys():
        return False
    if own["gate_up_proj"].dim() != 3 or any(p.shape[0] != num for p in own.values()):
        return False
    if any(next(child.parameters(), None) is not None for child in module.children()):
        return False  # sub-modules with parameters of their own: not the stacked layout
    return len(inspect.signature(module.forward).parameters) == 3


class _Dispatch:
    """The forward of an expert stack under ep (module docstring); wraps its own forward."""

    def __init__(self, local_forward, group: dist.ProcessGroup, num_experts: int) -> None:
        self.local_forward, self.group, self.num_experts = local_forward, group, num_experts

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        e_P, order = torch.sort(flat, stable=True)  # by expert, then (token, slot)
        routed = e_P < self.num_experts
        e_P, order = e_P[routed], order[routed]
        t_P = order // k
        w_P = top_k_weights.reshape(-1).index_select(0, order)
        exchange = TokenExchange(e_P, self.num_experts, self.group)
        rows = exchange.dispatch(hidden_states.index_select(0, t_P))
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        y = self.local_forward(rows, exchange.local_R.unsqueeze(1), ones)
        back = exchange.combine(y)
        weighted = w_P.unsqueeze(-1).to(back.dtype) * back
        return torch.zeros_like(hidden_states).index_add(0, t_P, weighted)


def shard_hf_experts(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Keep this ep rank's experts in ``module`` (an `is_hf_experts` stack) and dispatch its
    tokens by all-to-all, in place; returns the names of its parameters (all now local).

    Raises:
        ValueError: ep does not divide the module's number of experts.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    num = module.num_experts
    if num % ep:
        raise ValueError(f"expert parallelism: ep={ep} does not divide {num} experts")
    per_rank = num // ep
    keep = slice(rank * per_rank, (rank + 1) * per_rank)
    names = []
    for name, param in list(module.named_parameters(recurse=False)):
        local = nn.Parameter(param.detach()[keep].clone(), requires_grad=param.requires_grad)
        setattr(module, name, local)
        names.append(name)
    local_forward = type(module).forward.__get__(module)  # the family's own expert math
    module.num_experts = per_rank  # what that forward sees: local expert indices
    module.forward = _Dispatch(local_forward, group, num)  # instance attribute: nn.Module
    return names
