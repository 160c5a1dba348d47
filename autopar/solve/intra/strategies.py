"""Sharding strategies of one aten node on a 1-D tensor-parallel sub-mesh of t ranks.

In: a call node of the exported graph (`ModelGraph.graph_module`), its `NodeInfo`, t and the
device. Out: a tuple of `Strategy`: output placement(s), the placement each tensor input must
arrive in, and the compute time per rank. Invariant: every strategy is one DTensor accepts (or
"replicate everything"), and every Shard(d) divides its dim evenly (uneven shards are dropped).

Where the strategies come from, in order:

1. a rule in `autopar.solve.intra.rules` (`@register_rule(op)`), for the few ops DTensor has
   nothing for or answers badly;
2. DTensor's own propagator, `DTensor._op_dispatcher.sharding_propagator`, asked with every
   candidate placement of each input at once (R, P(sum) for floating tensors, S(d) for each
   evenly divisible dim d):
   - `op_single_dim_strategy_funcs` (pointwise ops, mm, ...): the single-dim rule expanded over
     the mesh by `_expand_single_dim_strategy_to_mesh`; on a 1-D mesh that is the whole list;
   - `op_strategy_funcs` (views, reductions, cat, flash attention, ...): each tensor input is an
     `OpStrategy` holding one `OpSpec` per candidate placement;
   - composite ops with neither (aten.linear, aten.scaled_dot_product_attention, layer_norm):
     `DecompShardingStrategy`, which runs the op's decomposition under placement tracking
     (linear = t + mm/addmm; sdpa = matmul, softmax, matmul), for every candidate combination;
3. "replicate everything" when none of these answers (listed in the plan).

Placements are torch's `Replicate`, `Shard(d)` and `Partial(reduce_op)`. Partial inputs other
than "sum" and `_StridedShard` anywhere are dropped: no producer in a layer makes them except
mean's P(avg) output, which a consumer that wants R receives through an all-reduce.

Compute time of strategy s (`op_time_s(device, op_class, flops_s, bytes_s, dtype)`):

    div_s    = t if any input or output of s is Shard, else 1
               (a Shard means each rank touches 1/t of that tensor and, in every DTensor rule,
               1/t of the op's iteration space; a Partial input alone is full-size locally)
    flops_s  = node.flops / div_s
    bytes_s  = sum over tensor inputs and outputs of local bytes (full / t when Shard)
    forward  = op_time_s(device, class, flops_s, bytes_s, dtype)
    backward = op_time_s(device, class, node.backward_flops / div_s, 2 bytes_s, dtype)
               (the backward reads the output gradient and the saved inputs and writes the
               input gradients: about twice the forward traffic; 0 when no grad is needed)

The device mesh is built without a process group (`DeviceMesh(..., _init_backend=False)`, as
DTensor's own decomposition path does), so asking leaves no global state behind.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.fx import Node
from torch.utils._pytree import tree_flatten

from autopar.solve.intra.rules import RULES, RuleContext
from autopar.tracing.graph import NodeInfo
from cost_models.compute import DeviceSpec, op_time_s

# bytes per element of a floating tensor at each training precision (IntraOptions.precision)
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the sub-mesh."""

    outputs: tuple[Placement, ...]  # one per tensor output
    inputs: tuple[Placement, ...]  # one per tensor input, in `tensor_inputs(node)` order
    compute_s: float  # forward, per rank
    backward_s: float
    source: str  # "rule", "dtensor", "decomposition" or "replicated"


@dataclass(frozen=True)
class NodeStrategies:
    name: str
    inputs: tuple[str, ...]  # producer names of the tensor inputs (repeats allowed)
    output_metas: tuple[TensorMeta, ...]
    strategies: tuple[Strategy, ...]


@functools.lru_cache(maxsize=16)
def sub_mesh(t: int) -> DeviceMesh:
    """A 1-D mesh of t ranks that needs no process group (only shapes are asked of it)."""
    return DeviceMesh("cpu", list(range(t)), _init_backend=False, _rank=0)


def tensor_inputs(node: Node) -> list[Node]:
    """The fx nodes of the tensor arguments, in DTensor's flattening order (args, kwargs)."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def tensor_meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def output_metas(node: Node) -> tuple[TensorMeta, ...]:
    flat, _ = tree_flatten(node.meta.get("val"))
    return tuple(tensor_meta(v) for v in flat if isinstance(v, torch.Tensor))


def candidate_placements(meta: TensorMeta, t: int) -> list[Placement]:
    """R, P(sum) for floating tensors, and S(d) for every dim that t divides."""
    out: list[Placement] = [Replicate()]
    if meta.dtype.is_floating_point:
        out.append(Partial())
    out += [Shard(d) for d, n in enumerate(meta.shape) if n >= t and n % t == 0]
    return out


def local_bytes(
    meta: TensorMeta, placement: Placement, t: int, float_bytes: int | None = None
) -> float:
    """Bytes of the tensor on one rank; floating tensors count `float_bytes` an element when
    given (the training precision, where the graph was traced in another dtype)."""
    itemsize = meta.dtype.itemsize
    if float_bytes is not None and meta.dtype.is_floating_point:
        itemsize = float_bytes
    full = math.prod(meta.shape) * itemsize
    return full / t if isinstance(placement, Shard) else float(full)


def _usable(
    strategy: Strategy, in_metas: list[TensorMeta], out_metas: tuple[TensorMeta, ...], t: int
) -> bool:
    for p in strategy.inputs:
        if isinstance(p, _StridedShard) or (isinstance(p, Partial) and p.reduce_op != "sum"):
            return False
    for p, m in zip(strategy.inputs + strategy.outputs, in_metas + list(out_metas), strict=False):
        if isinstance(p, _StridedShard):
            return False
        if isinstance(p, Shard) and (p.dim >= len(m.shape) or m.shape[p.dim] % t):
            return False
    return True


def _spec(meta: TensorMeta, placement: Placement, t: int) -> DTensorSpec:
    return DTensorSpec(sub_mesh(t), (placement,), tensor_meta=meta)


def _schema(node: Node, make: Any) -> OpSchema:
    """node's args with each tensor input replaced by `make(index, fx_node)` (lists kept)."""
    counter = iter(range(1 << 30))

    def conv(a: Any) -> Any:
        if isinstance(a, Node):
            return make(next(counter), a) if isinstance(a.meta.get("val"), torch.Tensor) else a
        if isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in a):
            items = [conv(x) for x in a]
            if all(isinstance(x, OpStrategy) for x in items):
                return TupleStrategy(tuple(items))
            return type(a)(items) if isinstance(a, tuple) else items
        return a

    args = tuple(conv(a) for a in node.args)
    kwargs = {k: conv(v) for k, v in node.kwargs.items()}
    return OpSchema(node.target, args, kwargs)


def _ask_dtensor(node: Node, t: int) -> tuple[list[tuple[tuple, tuple]], str]:
    """(outputs, inputs) placement pairs from DTensor's propagator; raises when it cannot."""
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _expand_single_dim_strategy_to_mesh,
    )

    prop = DTensor._op_dispatcher.sharding_propagator
    op = node.target
    metas = [tensor_meta(a.meta["val"]) for a in tensor_inputs(node)]
    first_sharded = next((i for i, m in enumerate(metas) if len(m.shape) > 0), None)
    outs = output_metas(node)
    out_meta: Any = outs[0] if len(outs) == 1 else outs
    source = "dtensor"
    if op in prop.op_single_dim_strategy_funcs:
        # One spec per input; a Shard among them lets placeholders expand to Shard(d).
        schema = _schema(
            node,
            lambda i, _: OpStrategy(
                [OpSpec(_spec(metas[i], Shard(0) if i == first_sharded else Replicate(), t))]
            ),
        )
        fn = _expand_single_dim_strategy_to_mesh(
            sub_mesh(t), schema, prop.op_single_dim_strategy_funcs[op], out_meta
        )
        result = fn(op, schema.args_meta, schema.kwargs_meta)
    elif op in prop.op_strategy_funcs:
        schema = _schema(
            node,
            lambda i, _: OpStrategy(
                [OpSpec(_spec(metas[i], p, t)) for p in candidate_placements(metas[i], t)]
            ),
        )
        result = prop.op_strategy_funcs[op](schema)
    elif prop.decomp_strategy.has_decomp(op):
        # The decomposition path takes its candidate set from the placements it is shown.
        schema = _schema(
            node,
            lambda i, _: _spec(metas[i], Shard(0) if i == first_sharded else Partial(), t),
        )
        prop.decomp_strategy.ensure_schema_info(op)
        result = prop.decomp_strategy.propagate_strategy(schema)
        source = "decomposition"
    else:
        raise NotImplementedError(f"DTensor has no sharding strategy for {op}")
    if result is None:
        raise NotImplementedError(f"DTensor's decomposition of {op} gave no strategy")
    return _pairs(result, len(metas)), source


def _pairs(result: Any, num_inputs: int) -> list[tuple[tuple, tuple]]:
    if isinstance(result, TupleStrategy):
        # Ops returning a list (split): one child per output, all reading the same input.
        children = [c for c in result.children if isinstance(c, OpStrategy)]
        combos = []
        for specs in zip(*(c.strategies for c in children), strict=False):
            combos.append(
                (
                    tuple(s.output_spec.placements[0] for s in specs),
                    tuple(x.placements[0] for x in specs[0].input_specs),
                )
            )
        return combos
    pairs = []
    for s in result.strategies:
        out = s.output_specs
        outs = (out,) if isinstance(out, DTensorSpec) else tuple(o for o in out if o is not None)
        ins = s.input_specs if s.input_specs is not None else (s.output_spec,) * num_inputs
        pairs.append((tuple(o.placements[0] for o in outs), tuple(i.placements[0] for i in ins)))
    return pairs


def splits_work(placements: tuple[Placement, ...]) -> bool:
    """True when each rank does 1/t of the op (some tensor of the strategy is Shard)."""
    return any(isinstance(p, Shard) for p in placements)


@dataclass(frozen=True)
class _Context:
    t: int
    device: DeviceSpec
    in_metas: list[TensorMeta]
    out_metas: tuple[TensorMeta, ...]
    param_inputs: frozenset[int]
    batch_scale: int
    precision: str | None = None  # "bf16", "fp16", "fp32": priced at it, not the traced dtype


def _compute(info: NodeInfo, outputs: tuple, inputs: tuple, ctx: _Context) -> tuple[float, float]:
    if info.op_class == "view":
        return 0.0, 0.0
    t = ctx.t
    div = t if splits_work(outputs + inputs) else 1
    moved = 0.0
    width = PRECISION_BYTES.get(ctx.precision) if ctx.precision else None
    for i, (m, p) in enumerate(zip(ctx.in_metas, inputs, strict=False)):
        scale = 1 if i in ctx.param_inputs else ctx.batch_scale
        moved += scale * local_bytes(m, p, t, width)
    moved += sum(
        ctx.batch_scale * local_bytes(m, p, t, width)
        for m, p in zip(ctx.out_metas, outputs, strict=False)
    )
    op_class = info.op_class if info.op_class != "other" else "elementwise"
    dtype = _DTYPE_NAMES.get(ctx.out_metas[0].dtype, "fp32") if ctx.out_metas else "fp32"
    if ctx.precision and ctx.out_metas and ctx.out_metas[0].dtype.is_floating_point:
        dtype = ctx.precision
    fwd = op_time_s(ctx.device, op_class, ctx.batch_scale * info.flops / div, moved, dtype)
    if not info.requires_grad:
        return fwd, 0.0
    bwd_flops = ctx.batch_scale * info.backward_flops / div
    return fwd, op_time_s(ctx.device, op_class, bwd_flops, 2 * moved, dtype)


def node_strategies(
    node: Node,
    info: NodeInfo,
    t: int,
    device: DeviceSpec,
    *,
    param_inputs: frozenset[int] = frozenset(),
    batch_scale: int = 1,
    precision: str | None = None,
) -> NodeStrategies:
    """Every usable strategy of `node` on t ranks, deduplicated, replicated first.

    Args:
        node: a call node of the exported graph (its `meta["val"]` gives shapes).
        info: the tracer's record of it (FLOPs, op class).
        t: tensor-parallel degree (ranks of the sub-mesh).
        device: what the compute times are priced on.
        param_inputs: indices of the tensor inputs that are parameters (not batch-scaled).
        batch_scale: samples per micro-batch (FLOPs and activation bytes scale with it).
        precision: price floating ops and bytes at this dtype ("bf16", "fp16", "fp32")
            instead of the traced one (a model traced in fp32 and trained in bf16).

    Returns:
        NodeStrategies; never empty ("replicate everything" is always there).
    """
    ins = tensor_inputs(node)
    in_metas = [tensor_meta(a.meta["val"]) for a in ins]
    out_metas = output_metas(node)
    rule = RULES.get(node.target)
    pairs: list[tuple[tuple, tuple]] = []
    source = "replicated"
    if rule is not None:
        pairs = rule(RuleContext(node, in_metas, out_metas, t))
        source = "rule"
    elif t > 1:
        try:
            pairs, source = _ask_dtensor(node, t)
        except Exception:  # noqa: BLE001 - any failure inside DTensor means "no rule"
            pairs = []
    replicated = (
        tuple(Replicate() for _ in out_metas),
        tuple(Replicate() for _ in in_metas),
    )
    ctx = _Context(t, device, in_metas, out_metas, param_inputs, batch_scale, precision)
    seen: dict[tuple[tuple, tuple], Strategy] = {}
    for outputs, inputs in [replicated, *pairs]:
        if len(outputs) != len(out_metas) or len(inputs) != len(in_metas):
            continue
        if (outputs, inputs) in seen:
            continue
        fwd, bwd = _compute(info, outputs, inputs, ctx)
        s = Strategy(outputs, inputs, fwd, bwd, source)
        if _usable(s, in_metas, out_metas, t):
            seen[(outputs, inputs)] = s
    return NodeStrategies(node.name, tuple(a.name for a in ins), out_metas, tuple(seen.values()))


def describe(p: Placement) -> str:
    """Short text of a placement: R, S(1), P(sum)."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return "R"
