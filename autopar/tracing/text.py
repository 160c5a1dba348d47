"""ModelGraph.as_text(): a per-layer table a person can read."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.tracing.graph import ModelGraph


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _mib(x: float) -> str:
    return f"{x / 2**20:9.1f}"


def model_graph_text(graph: ModelGraph) -> str:
    shapes = ", ".join("x".join(map(str, s)) for s in graph.input_shapes)
    lines = [
        f"ModelGraph of {graph.model_type}: inputs [{shapes}], {len(graph.nodes)} nodes, "
        f"{graph.num_params:,} parameters ({graph.param_bytes / 2**30:.2f} GiB), "
        f"{len(graph.layers)} layers in {len(graph.classes)} classes",
        f"FLOPs per sample: forward {_si(graph.forward_flops, 'FLOP')}, "
        f"backward {_si(graph.backward_flops, 'FLOP')}",
        "",
        f"{'layer':<28} {'class':<22} {'fwd FLOP':>12} {'params':>14} "
        f"{'act MiB none':>12} {'sel':>9} {'full':>9} {'out MiB':>9}",
    ]
    # Runs of consecutive members of one class print as one row, "x N".
    i = 0
    layers = graph.layers
    while i < len(layers):
        layer = layers[i]
        j = i
        while j + 1 < len(layers) and layers[j + 1].class_id == layer.class_id:
            j += 1
        name = layer.name if j == i else f"{layer.name} .. {layers[j].name.rsplit('.', 1)[-1]}"
        count = "" if j == i else f" x{j - i + 1}"
        act = layer.activation_bytes
        lines.append(
            f"{name[:28]:<28} {(layer.class_id + count)[:22]:<22} "
            f"{_si(layer.forward_flops, ''):>12} {layer.num_params:>14,} "
            f"{_mib(act['none']):>12} {_mib(act['selective'])} {_mib(act['full'])} "
            f"{_mib(layer.output_bytes)}"
        )
        if layer.moe is not None:
            m = layer.moe
            lines.append(
                f"{'':<28} MoE: {m.num_experts} experts, top-{m.top_k}, "
                f"{m.expert_params:,} params per expert, router {m.router}"
            )
        i = j + 1
    if graph.ops_without_sharding_rule:
        ops = sorted({op for _, op in graph.ops_without_sharding_rule})
        lines += ["", f"ops without a DTensor sharding rule (planned replicated): {', '.join(ops)}"]
    return "\n".join(lines)
