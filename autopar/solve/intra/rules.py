"""Sharding rules of our own, for the few ops DTensor's propagator cannot answer.

In: a `RuleContext` (the fx node, its tensor inputs' and outputs' `TensorMeta`, t).
Out: a list of (output placements, input placements) pairs, like DTensor's strategies; the
caller adds "replicate everything" and prices them. Rules are keyed by op overload and
registered with `@register_rule(op)`; one file per op family if this grows past a few.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import Placement
from torch.fx import Node

aten = torch.ops.aten

Pairs = list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]


@dataclass(frozen=True)
class RuleContext:
    node: Node
    input_metas: list[TensorMeta]
    output_metas: tuple[TensorMeta, ...]
    t: int


Rule = Callable[[RuleContext], Pairs]
RULES: dict[object, Rule] = {}


def register_rule(*ops: object) -> Callable[[Rule], Rule]:
    """Decorator: `rule` gives the strategies of `ops` (it replaces DTensor's answer)."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule

    return deco


def _arg(node: Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@register_rule(aten.scaled_dot_product_attention.default)
def attention_rule(ctx: RuleContext) -> Pairs:
    """q [B, H, Sq, D], k [B, Hk, Sk, D], v [B, Hk, Sk, Dv] (+ a mask) -> out [B, H, Sq, Dv].

    DTensor's decomposition path fails here (the causal mask is built with aten.ones, a factory
    op it cannot place), so the strategies of its flash-attention rule are written out:
    batch-sharded and head-sharded (all inputs sharded alike, heads as in Megatron-LM), v's
    feature dim sharded (q, k replicated), and, without a causal mask, query-sequence sharded
    (k, v replicated: each rank's rows see every key). The mask follows q's batch/head/row
    sharding where it has that dim and is replicated where it broadcasts (size 1).
    """
    q, k, v = ctx.input_metas[:3]
    mask = ctx.input_metas[3] if len(ctx.input_metas) > 3 else None
    causal = bool(_arg(ctx.node, 5, "is_causal", False))
    t = ctx.t

    def fits(meta: TensorMeta, dim: int) -> bool:
        return meta.shape[dim] % t == 0 and meta.shape[dim] >= t

    def mask_for(dim: int | None) -> tuple[Placement, ...]:
        if mask is None:
            return ()
        if dim is None or mask.shape[dim] == 1:
            return (Replicate(),)
        return (Shard(dim),) if fits(mask, dim) else (None,)  # type: ignore[return-value]

    pairs: Pairs = []
    for dim in (0, 1):  # batch, heads
        if fits(q, dim) and fits(k, dim) and fits(v, dim):
            pairs.append(((Shard(dim),), (Shard(dim),) * 3 + mask_for(dim)))
    if fits(v, 3):
        pairs.append(((Shard(3),), (Replicate(), Replicate(), Shard(3)) + mask_for(None)))
    if not causal and fits(q, 2):
        pairs.append(((Shard(2),), (Shard(2), Replicate(), Replicate()) + mask_for(2)))
    return [p for p in pairs if None not in p[1]]
