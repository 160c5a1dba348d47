"""The model's and the cluster's facts that bound the search space, and the default batch.

In: the model (its config names key/value heads), its traced `ModelGraph` and the `Cluster`.
Out: `SpaceLimits` (`autopar.solve.space`): world size, devices per node, repeated layers
(blocks), attention heads, sequence length, experts, global batch and micro-batch sizes. The
space and `shape_problems` read only these, so the search never needs the model itself.

`default_global_batch`: when the user gives no global batch, at most 4M tokens (Llama 2
pre-trained with 4M-token batches, Touvron et al. 2023, sec. 2.2); on CPU ranks, where 4M
tokens is a training run's batch and not a demonstration's, fewer: a step of at most
`CPU_STEP_AT_PEAK_S` at the cluster's peak (seconds, not minutes, once priced); a power of
two times the world size's odd factor, so that the data-parallel ranks of 3 or 6 devices
divide it. The plan states the choice in its notes.
"""

from __future__ import annotations

from typing import Any

from autopar.hardware import Cluster
from autopar.solve.space import SpaceLimits
from autopar.tracing import ModelGraph

DEFAULT_BATCH_TOKENS = 4 * 2**20


CPU_STEP_AT_PEAK_S = 0.25


def default_global_batch(
    seq_len: int,
    world_size: int = 1,
    flops_per_sequence: float = 0.0,
    cluster_flops_per_s: float = 0.0,
    max_step_at_peak_s: float | None = None,
) -> int:
    """Sequences per step when none is given (module docstring): 2^k x the odd factor of
    ``world_size``, the largest at most the target (4M tokens; with ``max_step_at_peak_s``,
    no more than the cluster's peak trains in that time), and at least that odd factor (model
    parallelism takes the devices a small batch leaves)."""
    target = max(1, DEFAULT_BATCH_TOKENS // max(seq_len, 1))
    if max_step_at_peak_s and flops_per_sequence > 0 and cluster_flops_per_s > 0:
        fast = int(max_step_at_peak_s * cluster_flops_per_s / flops_per_sequence)
        target = min(target, max(1, fast))
    odd = world_size // (world_size & -world_size)
    target = max(target, odd)
    power = 1
    while power * 2 * odd <= target:
        power *= 2
    return power * odd


def default_batch_for(graph: ModelGraph, cluster: Cluster, precision: str) -> tuple[int, str]:
    """`default_global_batch` for this model and cluster, and the plan's note saying so."""
    shapes = graph.input_shapes[0] if graph.input_shapes else (1,)
    seq_len, traced = shapes[-1], shapes[0] if len(shapes) > 1 else 1
    train_flops = sum(layer.forward_flops + layer.backward_flops for layer in graph.layers)
    peaks = cluster.profile.device.peak_flops_per_s
    peak = peaks.get(precision, peaks["fp32"]) * cluster.world_size * cluster.compute_share
    cap = CPU_STEP_AT_PEAK_S if cluster.profile.kind == "cpu" else None
    batch = default_global_batch(seq_len, cluster.world_size, train_flops / traced, peak, cap)
    tokens = batch * seq_len
    why = "about 4M" if tokens > DEFAULT_BATCH_TOKENS // 2 else "a step of seconds on CPU ranks"
    return batch, f"global batch not given: {batch} sequences ({tokens:,} tokens, {why})"


def space_limits(
    model: Any,
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
) -> SpaceLimits:
    """The model's and cluster's facts that bound the search space and refuse configs."""
    return SpaceLimits(
        world_size=cluster.world_size,
        devices_per_node=cluster.devices_per_node,
        num_blocks=sum(1 for layer in graph.layers if layer.kind == "block"),
        num_heads=attention_heads(graph),
        seq_len=_sequence_length(graph),
        num_experts=max((layer.moe.num_experts for layer in graph.layers if layer.moe), default=0),
        global_batch_size=global_batch_size,
        micro_batch_sizes=micro_batch_sizes,
        num_kv_heads=_kv_heads(model),
    )


def _sequence_length(graph: ModelGraph) -> int:
    """The sequence the repeated blocks run on: the middle dimension of the first block's first
    [batch, sequence, hidden] activation (a ViT's patches plus its class token; a transposed
    [sequence, batch, hidden] one is passed over by its batch), else the last dimension of the
    first input (token ids)."""
    fallback = graph.input_shapes[0][-1] if graph.input_shapes else 1
    batch = graph.input_shapes[0][0] if graph.input_shapes and graph.input_shapes[0] else 1
    blocks = [layer.name for layer in graph.layers if layer.kind == "block"]
    for node in graph.nodes.values() if blocks else ():
        if node.layer == blocks[0] and node.op != "parameter":
            for shape in node.shapes:
                if len(shape) == 3 and shape[0] == batch:
                    return shape[1]
    return fallback


def _kv_heads(model: Any) -> int:
    """Key/value heads from the model's config (zoo: num_kv_heads, Hugging Face:
    num_key_value_heads); 0 when the model does not say."""
    config = getattr(model, "config", None)
    for name in ("num_kv_heads", "num_key_value_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def attention_heads(graph: ModelGraph) -> int:
    """Heads of the first attention in the model (the tp degree must divide them), 0 if none."""
    for node in graph.nodes.values():
        if node.op_class == "attention" and node.inputs:
            q = graph.nodes[node.inputs[0]]
            if q.shapes and len(q.shapes[0]) == 4:
                return q.shapes[0][1]
    for node in graph.nodes.values():  # step-by-step attention: scores are [b, heads, s, s]
        if (
            node.op_class == "matmul"
            and not node.params
            and node.shapes
            and len(node.shapes[0]) == 4
        ):
            return node.shapes[0][1]
    return 0
