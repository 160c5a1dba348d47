"""The parts of a block that Megatron-Core's selective recompute names, found in the trace.

In: a block of the trace (`LayerInfo`) and the graph's nodes. Out: per name of
`autopar.config.RECOMPUTE_MODULES` that the block has, its `Region`: the ops it re-runs, the
saved values it frees and the values its checkpoint keeps instead. The tables price them
(`tables.LayerTable.module_regions`), the memory model and the layer times read them under
``recompute_modules`` (`memory.StageMemory.activation_bytes`, `layer_cost.layer_time`).

Found by structure, not by class or module names, from the block's direct submodules:
    layernorm       a submodule with no matmul that computes a reduction (mean, var) or an
                    rsqrt: a normalisation (input_layernorm, post_attention_layernorm)
    core_attn       in the submodule that computes attention: the attention ops, and in an
                    eager attention the ops between its two matmuls of activations (scores,
                    softmax, dropout, the product with the values)
    moe             the submodule that holds the MoE router
    shared_experts  in that submodule, its children with weight matmuls other than the router
                    and the experts
    moe_act         the experts' element-wise ops between their first and second matmuls (the
                    activation and the gating product)
    mlp             any other submodule with weight matmuls (a dense block's feed-forward)
    mla_up_proj     multi-head latent attention's up-projections and what they make up to the
                    attention's q, k and v (`kernel_savings.up_projection_region`)

How Megatron-Core checkpoints each (megatron/core/transformer/transformer_layer.py, mlp.py,
moe/experts.py, multi_latent_attention.py): core_attn, mlp, moe and shared_experts run under
`tensor_parallel.checkpoint`, which keeps the region's inputs and frees what it saves inside,
while its output stays as long as the ops after it save it; layernorm, moe_act and mla_up_proj
run under `CheckpointWithoutOutput`, which frees the output too once the next op has read it
and rematerialises it before that op's backward (``without_output``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from autopar.config import RECOMPUTE_MODULES
from autopar.estimate.kernel_savings import up_projection_region
from autopar.tracing.graph import LayerInfo, ModelGraph, NodeInfo

# Megatron-Core's CheckpointWithoutOutput regions (module docstring)
WITHOUT_OUTPUT = frozenset({"layernorm", "moe_act", "mla_up_proj"})
_REDUCTIONS = frozenset({"aten.mean.dim", "aten.var.correction", "aten.rsqrt.default",
                         "aten.var_mean.correction", "aten.native_layer_norm.default",
                         "aten.layer_norm.default", "aten.rms_norm.default"})  # fmt: skip


@dataclass(frozen=True)
class Region:
    """One recomputable part of a block: its ops (node names, in graph order), the saved
    values recomputing it frees, the values its checkpoint keeps (its inputs), and whether
    it frees its output too (`WITHOUT_OUTPUT`); ``module_paths``: the submodules it is, where
    it is whole submodules (a runtime can wrap them), else empty."""

    ops: tuple[str, ...]
    frees: frozenset[str]
    keeps: frozenset[str]
    without_output: bool
    module_paths: tuple[str, ...] = ()
    attention: bool = False  # holds the attention ops (their internal saved bytes go too)


def block_regions(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> dict[str, Region]:
    """The block's regions by name (module docstring); none for a layer outside the blocks."""
    if layer.kind != "block":
        return {}
    calls = [n for n in layer.nodes if nodes[n].kind == "call"]
    children: dict[str, list[str]] = {}
    prefix = layer.name + "."
    for name in calls:
        path = nodes[name].module_path
        if path.startswith(prefix):
            child = prefix + path[len(prefix) :].split(".")[0]
            children.setdefault(child, []).append(name)
    router = layer.moe.router if layer.moe else None
    found: dict[str, tuple[list[str], tuple[str, ...]]] = {}
    for child, ops in children.items():
        weights = [n for n in ops if nodes[n].op_class == "matmul" and nodes[n].params]
        products = [n for n in ops if nodes[n].op_class == "matmul" and not nodes[n].params]
        attention = [n for n in ops if nodes[n].op_class == "attention"]
        if router and (router == child or router.startswith(child + ".")):
            found["moe"] = (ops, (child,))
            shared = _shared_experts(child, ops, nodes, router)
            if shared[0]:
                found["shared_experts"] = shared
            act = _between(_expert_matmuls(ops, nodes), ops, nodes, _is_expert_op)
            if act:
                found["moe_act"] = (act, ())
        elif attention or products:
            core = _core_attention(attention, products, ops, nodes)
            if core:
                found["core_attn"] = (core, ())
        elif weights or any(nodes[n].op in _REDUCTIONS for n in ops):
            kind = "mlp" if weights else "layernorm"  # several submodules make one region
            before, paths = found.get(kind, ([], ()))
            found[kind] = (before + ops, (*paths, child))
    region, ups = up_projection_region(layer, nodes)
    if ups:
        found["mla_up_proj"] = ([n for n in calls if n in region or n in ups], ())
    saved = set(layer.saved_values.get("none", ()))
    order = {n: i for i, n in enumerate(calls)}
    return {
        kind: _region(kind, sorted(set(ops), key=order.__getitem__), paths, calls, nodes, saved)
        for kind, (ops, paths) in found.items()
    }


def _region(
    kind: str,
    ops: list[str],
    paths: tuple[str, ...],
    calls: list[str],
    nodes: dict[str, NodeInfo],
    saved: set[str],
) -> Region:
    inside = set(ops)
    read_outside = {i for n in calls if n not in inside for i in nodes[n].inputs}
    without = kind in WITHOUT_OUTPUT
    frees = {v for v in inside & saved if without or v not in read_outside}
    keeps = {
        i
        for n in ops
        for i in nodes[n].inputs
        if i not in inside
        and i in nodes
        and nodes[i].kind in ("call", "input")
        and nodes[i].requires_grad
    }
    return Region(
        ops=tuple(ops),
        frees=frozenset(frees),
        keeps=frozenset(keeps),
        without_output=without,
        module_paths=paths,
        attention=any(nodes[n].op_class == "attention" for n in ops),
    )


def _is_expert_op(node: NodeInfo) -> bool:
    return "experts" in node.module_path.split(".")


def _expert_matmuls(ops: list[str], nodes: dict[str, NodeInfo]) -> list[str]:
    """The experts' matmuls: on their weights, or on weights gathered per token."""
    return [n for n in ops if nodes[n].op_class == "matmul" and _is_expert_op(nodes[n])]


def _between(
    ends: list[str], ops: list[str], nodes: dict[str, NodeInfo], keep=lambda node: True
) -> list[str]:
    """The ops of ``ops`` other than ``ends`` that descend from one of ``ends`` and lead to
    another (the element-wise work between two matmuls), where ``keep`` holds."""
    members = set(ops)
    ends_set = set(ends)
    after: set[str] = set()
    for n in ops:  # graph order: an op after an end, or after such an op
        if any(i in ends_set or i in after for i in nodes[n].inputs) and n not in ends_set:
            after.add(n)
    readers: dict[str, list[str]] = {}
    for n in ops:
        for i in nodes[n].inputs:
            if i in members:
                readers.setdefault(i, []).append(n)
    before: set[str] = set()
    for n in reversed(ops):  # an op that an end, or such an op, reads
        if n not in ends_set and any(r in ends_set or r in before for r in readers.get(n, ())):
            before.add(n)
    return [n for n in ops if n in after and n in before and keep(nodes[n])]


def _core_attention(
    attention: list[str], products: list[str], ops: list[str], nodes: dict[str, NodeInfo]
) -> list[str]:
    """The attention ops, or an eager attention's two products of activations and the ops
    between them."""
    if attention:
        return list(attention)
    if len(products) < 2:
        return []
    middle = set(_between(products, ops, nodes))
    return [n for n in ops if n in middle or n in products]


def _shared_experts(
    moe: str, ops: list[str], nodes: dict[str, NodeInfo], router: str
) -> tuple[list[str], tuple[str, ...]]:
    """The MoE submodule's children with weight matmuls other than the router and the
    experts, and their ops."""
    prefix = moe + "."
    paths: list[str] = []
    for n in ops:
        node = nodes[n]
        path = node.module_path
        if not (node.op_class == "matmul" and node.params and path.startswith(prefix)):
            continue
        child = prefix + path[len(prefix) :].split(".")[0]
        if _is_expert_op(node) or router == child or router.startswith(child + "."):
            continue
        if child not in paths:
            paths.append(child)
    chosen = [
        n for n in ops if any(nodes[n].module_path == p or nodes[n].module_path.startswith(p + ".")
                              for p in paths)
    ]  # fmt: skip
    return chosen, tuple(paths)


@dataclass(frozen=True)
class RegionTable:
    """What re-running a region costs, as the tables price it (`tables.LayerTable`):
    positions in the layer's ``matmuls`` and ``attention``, its memory-bound ops (shard,
    bytes per sample, count), the bytes per sample of the tensor-parallel all-reduces of its
    row-parallel matmuls, and whether it holds the attention (context parallelism's traffic
    re-runs with it) or the whole MoE layer (the dispatch re-runs with it)."""

    matmuls: tuple[int, ...]
    attention: tuple[int, ...]
    memory_ops: tuple[tuple[str, float, int], ...]
    tp_allreduce_bytes: float
    has_attention: bool
    whole_moe: bool
    module_paths: tuple[str, ...] = ()


def region_tables(
    regions: dict[str, Region],
    matmul_nodes: list[str],
    attention_nodes: list[str],
    allreduce_nodes: dict[str, float],
    shard: dict[str, str],
    nodes: dict[str, NodeInfo],
) -> dict[str, RegionTable]:
    """Each region's `RegionTable`; ``matmul_nodes`` / ``attention_nodes``: the node of each
    entry of the table's ``matmuls`` / ``attention``; ``allreduce_nodes``: the row-parallel
    matmuls' all-reduce bytes per sample by node; ``shard``: each node's class."""
    out = {}
    for kind, region in regions.items():
        ops = set(region.ops)
        memory: dict[str, list[float]] = {}
        for name in region.ops:
            node = nodes[name]
            if node.op_class in ("elementwise", "reduction"):
                entry = memory.setdefault(shard.get(name, "rep"), [0.0, 0])
                entry[0] += node.bytes_read + node.bytes_written
                entry[1] += 1
        out[kind] = RegionTable(
            matmuls=tuple(i for i, n in enumerate(matmul_nodes) if n in ops),
            attention=tuple(i for i, n in enumerate(attention_nodes) if n in ops),
            memory_ops=tuple((k, v[0], int(v[1])) for k, v in memory.items()),
            tp_allreduce_bytes=sum(b for n, b in allreduce_nodes.items() if n in ops),
            has_attention=region.attention,
            whole_moe=kind == "moe",
            module_paths=region.module_paths,
        )
    return out


def in_order(kinds: Collection[str]) -> tuple[str, ...]:
    """``kinds`` in Megatron's order (`RECOMPUTE_MODULES`), each once."""
    return tuple(k for k in RECOMPUTE_MODULES if k in kinds)


def regions_named(
    present: Collection[str], modules: tuple[str, ...], up_projections: bool
) -> tuple[str, ...]:
    """The regions of ``present`` (a block's) that ``modules`` re-run, with MLA's
    up-projections where the stack recomputes them anyway
    (`CostOptions.recompute_up_projections`), in Megatron's order."""
    wanted = set(modules) | ({"mla_up_proj"} if up_projections else set())
    return in_order(wanted & set(present))


def model_regions(graph: ModelGraph) -> tuple[str, ...]:
    """The region names any block of ``graph`` (a `ModelGraph`) has, in Megatron's order."""
    found: set[str] = set()
    for layer in graph.layers:
        found |= set(block_regions(layer, graph.nodes))
    return in_order(found)


# the regions whose re-run is element-wise or small (Megatron's CheckpointWithoutOutput ones)
# and those that re-run a whole feed-forward
_CHEAP = ("moe_act", "layernorm", "mla_up_proj")
_HEAVY = ("mlp", "moe")


def module_sets(present: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The ``recompute_modules`` sets a search offers for a model with regions ``present``:
    the cheap regions together, and each whole feed-forward with them (a moe re-run takes its
    experts' activations with it) -- sets Megatron's recipes name, not every subset. A whole
    feed-forward alone is left out: the cheap regions beside it save memory for little time,
    and each set offered costs the search a pass (DeepSeek-V3 on 128 DGX H100, megatron-core,
    `benchmarks/plan_speed.py`'s case on that stack: search 15.8 s without sets, 27.8 s with
    five, 24.1 s with the three offered here)."""

    cheap = [k for k in _CHEAP if k in present]
    out = [in_order(cheap)] if cheap else []
    for heavy in (k for k in _HEAVY if k in present):
        out.append(
            in_order([heavy, *(k for k in cheap if not (heavy == "moe" and k == "moe_act"))])
        )
    return tuple(dict.fromkeys(out))
