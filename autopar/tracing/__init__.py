"""trace: nn.Module + one sample's inputs -> ModelGraph.

Phases inside: capture (torch.export on fake tensors) -> node table (shapes, FLOPs, bytes,
saved tensors, measured per op on meta tensors) -> layers (blocks and their structural classes)
-> per-layer tables. See `autopar.tracing.graph` for what comes out.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from autopar.tracing.capture import TraceError, capture
from autopar.tracing.causal_calls import count_causal_calls
from autopar.tracing.graph import LayerClass, LayerInfo, ModelGraph, MoEInfo, NodeInfo, ParamInfo
from autopar.tracing.layers import assign_layers, find_blocks, linear_of
from autopar.tracing.nodes import RawNode, build_node_table
from autopar.tracing.ops import OpProber
from autopar.tracing.summarize import summarize_layers

__all__ = [
    "LayerClass",
    "LayerInfo",
    "ModelGraph",
    "MoEInfo",
    "NodeInfo",
    "ParamInfo",
    "TraceError",
    "is_lifted_constant",
    "trace",
]


def trace(model: nn.Module, example_inputs: Any) -> ModelGraph:
    """Capture ``model`` and measure it, per node and per layer, for one sample.

    Args:
        model: any nn.Module; parameters may live on the meta device (nothing is allocated).
        example_inputs: a tensor or a tuple of positional inputs describing ONE sample
            (batch dimension 1); meta tensors are fine.

    Returns:
        A ModelGraph (print it with ``.as_text()``).

    Raises:
        TraceError: the model cannot be captured; the message names the op and module path.
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    program = capture(model, inputs)
    prober = OpProber()
    table = build_node_table(program, model, prober)
    count_causal_calls(model, table)  # a causal mask made only for the export
    blocks = find_blocks(model)
    layer_of = assign_layers(table, blocks)
    layers, classes, params = summarize_layers(table, layer_of, blocks, model)
    return ModelGraph(
        model_type=type(model).__name__,
        model_module=type(model).__module__,
        input_shapes=tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)),
        nodes={r.name: _node_info(r, layer_of) for r in table},
        layers=layers,
        classes=classes,
        parameters=params,
        ops_without_sharding_rule=_ops_without_rule(program),
        graph_module=program.graph_module,
        linears={
            path: linear
            for path, m in model.named_modules()
            if (linear := linear_of(m)) is not None
        },
        meta_constants=tuple(
            name
            for name, value in program.constants.items()
            if is_lifted_constant(name)  # not the model's own buffers
            and isinstance(value, torch.Tensor)
            and value.is_meta
            and value.numel()
        ),  # fmt: skip
    )


def is_lifted_constant(name: str) -> bool:
    """Whether ``name`` is a tensor torch.export lifted out of the model's code into its graph
    (``...lifted_tensor_3``), not one of the model's parameters or buffers."""
    return name.rsplit(".", 1)[-1].startswith("lifted_tensor")


def _node_info(raw: RawNode, layer_of: dict[str, str]) -> NodeInfo:
    return NodeInfo(
        name=raw.name,
        op=raw.op,
        kind=raw.kind,
        op_class=raw.op_class,
        inputs=raw.inputs,
        shapes=raw.shapes,
        dtypes=raw.dtypes,
        requires_grad=raw.requires_grad,
        flops=raw.flops,
        backward_flops=raw.backward_flops,
        bytes_read=raw.bytes_read,
        bytes_written=raw.bytes_written,
        params=raw.params,
        module_path=raw.module_stack[-1][0] if raw.module_stack else "",
        layer=layer_of[raw.name],
    )


def _ops_without_rule(program: torch.export.ExportedProgram) -> tuple[tuple[str, str], ...]:
    """Nodes whose op DTensor cannot shard: neither a strategy nor a decomposition for it."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    known = (
        set(propagator.op_strategy_funcs)
        | set(propagator.op_single_dim_strategy_funcs)
        | set(propagator.op_to_rules)
    )
    missing = []
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or target is operator.getitem:
            continue
        if not isinstance(target, torch._ops.OpOverload) or target in known:
            continue
        if not node.all_input_nodes or not isinstance(node.meta.get("val"), torch.Tensor | tuple):
            continue  # factories (arange) are made on every rank; asserts produce nothing
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), "CompositeImplicitAutograd"
        ):
            continue  # decomposed into ops DTensor knows before it sees it
        missing.append((node.name, str(target)))
    return tuple(missing)
