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
