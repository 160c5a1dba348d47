"""Node table: an ExportedProgram -> per-node facts (shapes, FLOPs, bytes, params, module path).

In: the exported program and the model's parameters. Out: `RawNode`s in graph order (the layer
of each node is filled in later by `layers.assign_layers`) and the saved-for-backward facts the
activation accounting needs.

Bytes: an op whose output aliases an input's storage (a view) moves nothing; any other op reads
its tensor inputs once and writes its outputs once. requires_grad flows forward from the
parameters that require grad; user inputs and buffers do not require grad.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from autopar.tracing.graph import NodeKind, OpClass
from autopar.tracing.ops import OpProber, op_class_of


@dataclass
class RawNode:
    """A node before layer assignment (mutable while the table is built)."""

    name: str
    op: str
    kind: NodeKind
    op_class: OpClass
    inputs: tuple[str, ...]
    tensor_inputs: tuple[str, ...]  # flattened tensor args in call order, for saved_args
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int
    requires_grad: bool
    flops: float = 0.0
    backward_flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    params: tuple[str, ...] = ()
    module_stack: tuple[tuple[str, str], ...] = ()  # (path, type), outermost first
    saved_inputs: tuple[str, ...] = ()  # graph values this op keeps for backward
    saved_self: bool = False  # its own output is kept for backward
    saved_internal_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _tensors(val: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]


def _nbytes(val: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(val))


def _is_view(node: fx.Node) -> bool:
    outs = _tensors(node.meta.get("val"))
    if not outs:
        return False
    ins = {
        StorageWeakRef(t.untyped_storage())
        for a in node.all_input_nodes
        for t in _tensors(a.meta.get("val"))
    }
    return all(StorageWeakRef(t.untyped_storage()) in ins for t in outs)


def build_node_table(
    program: torch.export.ExportedProgram, model: torch.nn.Module, prober: OpProber
) -> list[RawNode]:
    """Every node of the program's graph with its measured facts, in graph order."""
    # Tied weights have several names; every name maps to the one named_parameters() reports.
    canonical = {id(p): n for n, p in model.named_parameters()}
    alias = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    kinds = {
        k: (kind, alias.get(target, target))
        for k, (kind, target) in _placeholder_kinds(program).items()
    }
    grad_params = {n for n, p in model.named_parameters() if p.requires_grad}
    table: dict[str, RawNode] = {}
    for node in program.graph.nodes:
        raw = _raw_node(node, kinds, grad_params, table)
        if raw.kind == "call" and node.target is not operator.getitem:
            _measure(node, raw, table, prober)
        table[raw.name] = raw
    return list(table.values())


def _placeholder_kinds(program: torch.export.ExportedProgram) -> dict[str, tuple[NodeKind, str]]:
    kinds: dict[str, tuple[NodeKind, str]] = {}
    for spec in program.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind == InputKind.PARAMETER:
            kinds[name] = ("parameter", spec.target or name)
        elif spec.kind == InputKind.BUFFER:
            kinds[name] = ("buffer", spec.target or name)
        elif spec.kind == InputKind.USER_INPUT:
            kinds[name] = ("input", name)
        else:
            kinds[name] = ("constant", spec.target or name)
    return kinds


def _raw_node(
    node: fx.Node,
    kinds: dict[str, tuple[NodeKind, str]],
    grad_params: set[str],
    table: dict[str, RawNode],
) -> RawNode:
    val = node.meta.get("val")
    tensors = _tensors(val)
    inputs = tuple(a.name for a in node.all_input_nodes)
    flat_args = tree_flatten((node.args, node.kwargs))[0]
    tensor_inputs = tuple(
        a.name
        for a in flat_args
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    )
    stack = tuple(
        (path, str(typ)) for path, typ in (node.meta.get("nn_module_stack") or {}).values()
    )
    floating = any(t.dtype.is_floating_point for t in tensors)
    if node.op == "placeholder":
        kind, target = kinds.get(node.name, ("input", node.name))
        op, op_class, params = kind, "other", ((target,) if kind == "parameter" else ())
        requires_grad = kind == "parameter" and target in grad_params
    elif node.op == "output":
        kind, op, op_class, params, requires_grad = "output", "output", "other", (), False
    else:
        kind, op = "call", str(node.target)
        view = node.target is operator.getitem or _is_view(node)
        op_class = op_class_of(op, view, floating)
        # parameters read through views (t(weight), weight.to(bf16)) count for the reader
        params = tuple(dict.fromkeys(p for i in inputs for p in _view_params(table[i])))
        requires_grad = floating and any(table[i].requires_grad for i in inputs)
    extra = {"k": int(node.args[1])} if op.startswith("aten.topk") else {}
    return RawNode(
        name=node.name,
        op=op,
        kind=kind,  # type: ignore[arg-type]
        op_class=op_class,  # type: ignore[arg-type]
        inputs=inputs,
        tensor_inputs=tensor_inputs,
        shapes=tuple(tuple(int(d) for d in t.shape) for t in tensors),
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        nbytes=_nbytes(val),
        requires_grad=requires_grad,
        params=params,
        module_stack=stack,
        extra=extra,
    )


def _view_params(raw: RawNode) -> tuple[str, ...]:
    if raw.kind == "parameter" or raw.op_class == "view":
        return raw.params
    return ()


def _measure(node: fx.Node, raw: RawNode, table: dict[str, RawNode], prober: OpProber) -> None:
    if raw.op_class == "view":
        return
    input_bytes = sum(table[i].nbytes for i in raw.inputs)
    raw.bytes_read, raw.bytes_written = input_bytes, raw.nbytes
    if not any(table[i].requires_grad for i in raw.inputs) and raw.op_class not in (
        "matmul",
        "attention",
    ):
        return  # no autograd and no FLOPs worth counting: index arithmetic, masks, casts of ids
    args, kwargs = _values(node.args), _values(node.kwargs)
    grad_mask = [table[name].requires_grad for name in raw.tensor_inputs]
    profile = prober.profile(node.target, args, kwargs, grad_mask)
    raw.flops, raw.backward_flops = profile.flops, profile.backward_flops
    raw.saved_inputs = tuple(dict.fromkeys(raw.tensor_inputs[i] for i in profile.saved_args))
    raw.saved_self = bool(profile.saved_outputs)
    raw.saved_internal_bytes = profile.saved_internal_bytes
    raw.extra["probed"] = profile.probed


def _values(tree: Any) -> Any:
    return fx.node.map_arg(tree, lambda n: n.meta.get("val"))
