"""A layer's saved activations by recompute policy and tensor-parallel class.

In: a layer of the trace, the graph's nodes, each node's class from the tables' propagation
(`tables._shard_walk`), the values that are weights' copies, and the value sets some stacks
keep otherwise (`kernel_savings`) or recompute by module (`module_regions`). Out:
``{policy: {shard class: bytes per sample}}``, `LayerTable.activations`:

    none, selective, full   the trace's policies (`autopar.tracing.summarize`)
    -up_proj, -fused, +fp32 parts of "none" a stack keeps otherwise (`kernel_savings`)
    modules:A+B             Megatron-Core's selective recompute of the regions A and B
                            (`module_policy`): "none" less what the regions free, plus the
                            inputs their checkpoints keep, less the outputs of those that free
                            them too (a checkpoint's input that another region frees is freed:
                            Megatron frees the storage, `module_regions`); with "-fused" and
                            "+fp32" beside it, those parts of what it keeps

A class is the value's own ("tp", "rep", "expert"), "gathered" for a replicated value a
column-parallel matmul reads (what SP all-gathers before it), "routed" for an expert value as
wide as the block's input (expert tensor parallelism splits only the intermediate width).
"""

from __future__ import annotations

import itertools
import math

from autopar.estimate.module_regions import Region, in_order
from autopar.tracing.graph import LayerInfo, NodeInfo

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}  # by trace dtype
_CLASSES = ("tp", "rep", "expert", "gathered", "routed")
MODULES = "modules:"


def value_bytes(node: NodeInfo) -> float:
    """The bytes of a node's tensor outputs."""
    return float(
        sum(
            math.prod(s) * DTYPE_BYTES.get(d, 1)
            for s, d in zip(node.shapes, node.dtypes, strict=False)
        )
    )


def module_policy(kinds: tuple[str, ...]) -> str:
    """The policy name of recomputing ``kinds`` (in `RECOMPUTE_MODULES` order), or "none"."""
    return MODULES + "+".join(kinds) if kinds else "none"


def module_kinds(policy: str) -> tuple[str, ...] | None:
    """The regions a module policy re-runs; None for another policy or a policy's part."""
    if not policy.startswith(MODULES) or policy.endswith(("-fused", "+fp32")):
        return None
    return tuple(policy[len(MODULES) :].split("+"))


def activation_split(
    layer: LayerInfo,
    nodes: dict[str, NodeInfo],
    shard: dict[str, str],
    derived: set[str],
    hidden: int | None,
    parts: dict[str, frozenset[str]],
    regions: dict[str, Region],
) -> dict[str, dict[str, float]]:
    """The layer's split (module docstring); ``hidden``: an MoE block's width, else None;
    ``parts``: "-up_proj", "-fused" and "+fp32"'s values."""
    gathered = {
        i
        for name in layer.nodes
        if nodes[name].op_class == "matmul" and nodes[name].params and shard.get(name) == "tp"
        for i in nodes[name].inputs
    }

    def split(values, internal: float) -> dict[str, float]:
        out = dict.fromkeys(_CLASSES, 0.0)
        for v in values:
            if v in derived:
                continue
            kind = shard.get(v, "rep")
            kind = "gathered" if kind == "rep" and v in gathered else kind
            wide = hidden is not None and nodes[v].shapes and nodes[v].shapes[0][-1:] == (hidden,)
            kind = "routed" if kind == "expert" and wide else kind
            out[kind] += value_bytes(nodes[v])
        out["tp"] += internal  # attention statistics
        return out

    internal = layer.saved_internal_bytes
    sets = {**layer.saved_values, **parts}
    result = {policy: split(values, internal.get(policy, 0.0)) for policy, values in sets.items()}
    none = set(layer.saved_values.get("none", ()))
    for kinds in _combinations(regions):
        chosen = [regions[k] for k in kinds]
        freed = set().union(*(r.frees for r in chosen))
        wholly = set().union(*(r.frees for r in chosen if r.without_output))
        kept = ((none - freed) | set().union(*(r.keeps for r in chosen))) - wholly
        # the attention's own saved statistics go where its ops re-run
        stats = internal.get("none", 0.0) - (
            internal.get("selective", 0.0) if any(r.attention for r in chosen) else 0.0
        )
        name = module_policy(kinds)
        result[name] = split(kept, stats)
        result[name + "-fused"] = split(kept & parts["-fused"], 0.0)
        result[name + "+fp32"] = split(kept & parts["+fp32"], 0.0)
    return result


def _combinations(regions: dict[str, Region]):
    """Every non-empty set of the block's regions a config can name (moe not with the parts
    inside it: `ParallelConfig.problems`), in Megatron's order."""
    names = in_order(regions)
    for n in range(1, len(names) + 1):
        for kinds in itertools.combinations(names, n):
            if "moe" in kinds and ("moe_act" in kinds or "shared_experts" in kinds):
                continue
            yield kinds
