"""A layer's table as a runtime runs it, where that differs from the traced graph.

In: a `LayerTable` (`autopar.estimate.tables`). Out: the same layer with its vocabulary whole on
every tp rank (`whole_vocabulary`: a stack that splits it only without context parallelism), or
with its experts at the top-k routed rows (`routed_layer`: a runtime that dispatches tokens to
their experts, where the traced graph runs every expert on every token). The estimator applies
them per config (`memory.vocab_whole`, `memory.dispatched`).
"""

from __future__ import annotations

from dataclasses import replace

from autopar.estimate.saved_split import module_kinds
from autopar.estimate.tables import LayerTable, MatmulOp


def whole_vocabulary(table: LayerTable) -> LayerTable:
    """``table`` as a runtime that does not split the vocabulary runs it: a token embedding or
    an LM head whole on every tp rank (its weights replicated, its matmul and logits per
    context shard only, no vocabulary-parallel all-reduce); any other layer unchanged."""
    if not (table.token_embedding or table.vocab_logits_bytes) or not table.vocab_split:
        return table
    return replace(
        table,
        matmuls=tuple(replace(m, shard="whole") if m.shard == "tp" else m for m in table.matmuls),
        tp_allreduce_bytes=(),
        params_tp=0,
        params_rep=table.params_rep + table.params_tp,
        vocab_split=False,
    )


def routed_layer(table: LayerTable, imbalance: float = 1.0) -> LayerTable:
    """``table`` with its expert work at the routed rows: what a dispatching runtime runs.

    A dense-dispatch MoE's graph (`autopar.models.moe`) runs all E experts on all T tokens;
    dispatched, the experts run k T rows in all (each token on its top k). Every expert-class
    term -- matmul FLOPs and activation bytes, memory-bound bytes, saved activations (the
    "expert" and the hidden-wide "routed" ones) -- scales by f = k / E; weights, the router and
    the combine's replicated work do not. The dispatch itself keeps two more copies of the
    routed rows without recompute, or under a module policy that does not re-run the MoE layer
    (D = moe_dispatch_bytes, k T H per sample, in "routed"):
    each expert's gathered input rows (the dense graph's experts share the block's x) and the
    weighted rows `index_add` keeps (`autopar.runtime.expert_parallel`;
    measured on moe-tiny EP2: rows of 64 x 64 fp32, two per layer beyond the experts').
    ``imbalance``: the busiest rank's routed rows over the mean (`CostOptions.moe_imbalance`):
    every expert-class term and the dispatched rows (moe_dispatch_bytes, which the all-to-all
    moves) of that rank scale by it. The table itself when f = 1 and the routing is even (a
    graph that routes already, or no MoE)."""
    f = table.moe_routed_fraction
    if not table.moe_num_experts or (f == 1.0 and imbalance == 1.0):
        return table
    dispatch = table.moe_dispatch_bytes * imbalance
    keeps_rows = [p for p in table.activations if _keeps_dispatched_rows(p)]
    extra = dict.fromkeys(keeps_rows, 2 * dispatch) if f != 1.0 else {}
    f *= imbalance

    def matmul(op: MatmulOp) -> MatmulOp:
        if op.shard != "expert":
            return op
        return replace(
            op,
            flops=op.flops * f,
            backward_flops=op.backward_flops * f,
            weight_grad_flops=op.weight_grad_flops * f,
            activation_bytes=op.activation_bytes * f,
        )

    return replace(
        table,
        matmuls=tuple(matmul(op) for op in table.matmuls),
        memory_ops=_routed_ops(table.memory_ops, f),
        module_regions={
            k: replace(r, memory_ops=_routed_ops(r.memory_ops, f))
            for k, r in table.module_regions.items()
        },
        # the dispatch's rows are hidden-wide: their own class ("routed", which expert tensor
        # parallelism does not split)
        activations={
            policy: {
                **{k: v * f if k in ("expert", "routed") else v for k, v in split.items()},
                "routed": split.get("routed", 0.0) * f + extra.get(policy, 0.0),
            }
            for policy, split in table.activations.items()
        },
        moe_dispatch_bytes=dispatch,
        moe_routed_fraction=1.0,
    )


def _keeps_dispatched_rows(policy: str) -> bool:
    """No recompute, or a module policy that does not re-run the whole MoE layer."""
    kinds = module_kinds(policy)
    return policy == "none" or (kinds is not None and "moe" not in kinds)


def _routed_ops(
    ops: tuple[tuple[str, float, int], ...], f: float
) -> tuple[tuple[str, float, int], ...]:
    """Memory-bound ops (shard, bytes, count) with the experts' bytes at f of the traced."""
    return tuple((s, b * f if s == "expert" else b, n) for s, b, n in ops)
