"""The README's main job, as far as the project goes today.

In: a shipped cluster profile and node count. Out: printed text: the cluster, then the cost
model's figures for one Llama 3 8B training step's parts on it (per-layer GEMM time, the
collectives each parallel axis issues, memory per device by ZeRO stage, the pipeline bubble).

The model here is Llama 3 8B's published shape written out by hand, because the tracer (which
will read it from the real Hugging Face model) and the planner arrive in later issues; this
module then becomes `parallelize` + `plan.save` + a torchrun launch of the generated program.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from cost_models.compute import op_time_s
from cost_models.memory import model_state_bytes, transformer_layer_activation_bytes
from cost_models.pipeline import simulate_pipeline


@dataclass(frozen=True)
class DecoderShape:
    """Shape of a Llama-style decoder (Llama 3 8B: Meta's model card / HF config.json)."""

    num_layers: int = 32
    hidden: int = 4096
    ffn_hidden: int = 14336
    num_heads: int = 32
    num_kv_heads: int = 8
    vocab: int = 128256
    seq_len: int = 8192

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.hidden * self.num_kv_heads // self.num_heads
        return h * (h + 2 * kv) + h * h + 3 * h * self.ffn_hidden + 2 * h

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden


def run_demo(profile: str = "dgx_h100", num_nodes: int = 2) -> str:
    """Price the parts of a Llama 3 8B step on ``num_nodes`` nodes of ``profile``."""
    cluster = Cluster.from_profile(profile, num_nodes=num_nodes)
    shape = DecoderShape()
    world = cluster.world_size
    per_node = cluster.devices_per_node
    tokens = shape.seq_len  # one sequence per micro-batch
    lines = [cluster.as_text(), "", f"Llama 3 8B shape: {shape.num_params / 1e9:.2f} B parameters"]

    gemm_flops = 2 * tokens * shape.layer_params
    gemm_s = op_time_s(cluster.profile.device, "matmul", gemm_flops, 0, "bf16")
    lines.append(
        f"  one decoder layer's forward GEMMs, 1 x {tokens} tokens, bf16: "
        f"{gemm_s * 1e3:.2f} ms ({gemm_flops / 1e12:.2f} TFLOP)"
    )

    lines.append("\nCollectives (cheapest algorithm per call):")
    activation_bytes = tokens * shape.hidden * 2
    layer_bytes = shape.layer_params * 2
    grad_bytes = shape.num_params * 2
    tp_group = range(min(8, per_node))
    for label, collective, size, ranks in (
        (f"TP={len(tp_group)} activation all-reduce", "all_reduce", activation_bytes, tp_group),
        (f"FSDP={world} layer all-gather", "all_gather", layer_bytes, range(world)),
        (f"DP={world} gradient all-reduce", "all_reduce", grad_bytes, range(world)),
        ("PP send/recv across nodes", "send_recv", activation_bytes, [0, per_node % world]),
    ):
        est = cluster.collective_time(collective, size, ranks)
        lines.append(f"  {label:<34} {est.as_text()}  [{cluster.level_of(ranks)}]")

    lines.append(f"\nMemory per device, bf16 + AdamW, sharded over {world} ranks:")
    act = transformer_layer_activation_bytes(
        seq_len=shape.seq_len,
        micro_batch_size=1,
        hidden=shape.hidden,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        ffn_hidden=shape.ffn_hidden,
        dropout=False,
        flash_attention=True,
        gated_mlp=True,
    )
    activations = act.total_bytes * shape.num_layers
    capacity = cluster.profile.device.memory_bytes
    for stage in range(4):
        state = model_state_bytes(
            shape.num_params,
            precision="bf16",
            optimizer="adamw",
            zero_stage=stage,
            shard_degree=world,
        )
        total = state.total_bytes + activations
        fits = "fits" if total <= capacity else "does not fit"
        lines.append(
            f"  ZeRO-{stage}: state {state.total_bytes / 2**30:6.1f} GiB + activations "
            f"{activations / 2**30:5.1f} GiB = {total / 2**30:6.1f} GiB "
            f"({fits} in {capacity / 2**30:.0f} GiB)"
        )

    lines.append("\nPipeline of 4 stages x 8 layers, 16 micro-batches:")
    f_s = 8 * gemm_s  # a stage of 8 layers; backward-input and -weight each cost a forward
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
        result = simulate_pipeline(
            schedule,  # type: ignore[arg-type]
            4,
            16,
            forward_s=[f_s] * 4,
            backward_input_s=[f_s] * 4,
            backward_weight_s=[f_s] * 4,
            virtual_stages=v,
        )
        lines.append(
            f"  {schedule:<18} step {result.step_time_s * 1e3:8.1f} ms, "
            f"bubble {result.bubble_fraction:.3f}"
        )
    lines.append(
        "\n(Planning, code generation and the local CPU run join this job as issues 3-6 land.)"
    )
    return "\n".join(lines)
