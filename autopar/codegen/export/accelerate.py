"""A plan as a Hugging Face Accelerate config file (`accelerate launch --config_file`), FSDP2
with Accelerate's parallelism config (dp_replicate x dp_shard x tp x cp).

    dp, fsdp, tp, cp     parallelism_config_dp_replicate_size, _dp_shard_size, _tp_size, _cp_size
    zero_stage           fsdp_reshard_after_forward: true for 3, false for 1-2
    recompute            fsdp_activation_checkpointing (every block, full)
    precision            mixed_precision bf16 / fp16 / fp8 (a low-precision recipe) / no

Accelerate has no pipeline or expert parallelism for training: a plan with pp > 1 has its
pipeline ranks folded into the shard axis, and the file says so.
"""

from __future__ import annotations

from autopar.codegen.export.common import Exported, ModelShape, Priced, header_lines
from autopar.config.precision import recipe_of
from autopar.plan.types import Plan


def export_accelerate(plan: Plan, shape: ModelShape | None, priced: Priced | None) -> Exported:
    del shape  # Accelerate wraps the user's own model
    c = plan.config
    gaps: list[str] = []
    shard = c.fsdp
    if c.pp > 1:
        shard *= c.pp
        gaps.append(
            f"pp={c.pp}: Accelerate has no pipeline parallelism for training; its ranks are "
            f"folded into the shard axis (dp_shard_size {shard}): a different plan, re-plan "
            "with pp=1 for its prediction"
        )
    if c.ep > 1:
        gaps.append(f"ep={c.ep}: Accelerate has no expert parallelism; the experts replicate")
    if c.zero_stage == 1:
        gaps.append("zero_stage=1: FSDP2 shards gradients as well (ZeRO-2)")
    if c.recompute == "selective" or c.recompute_layers is not None:
        gaps.append(f"recompute={c.recompute_text}: Accelerate checkpoints every block in full")
    if c.tp > 1 and not c.sequence_parallel:
        gaps.append("tp without sequence parallelism: the model's tp plan decides")
    if c.micro_batch_size * plan.num_microbatches > c.micro_batch_size:
        gaps.append(
            f"{plan.num_microbatches} micro-batches of {c.micro_batch_size}: pass "
            f"gradient_accumulation_steps={plan.num_microbatches} to Accelerator() and a "
            f"per-device batch of {c.micro_batch_size} to the data loader (not in this file)"
        )
    sharded = shard > 1 or c.tp > 1 or c.cp > 1
    # accelerate's "fp8" runs TransformerEngine or torchao (its fp8 backend kwargs)
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "no")
    if recipe_of(plan.precision) is not None:
        precision = "fp8"
    config: dict[str, object] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if sharded else "MULTI_GPU",
        "mixed_precision": precision,
        "num_machines": plan.num_nodes,
        "num_processes": plan.world_size,
        "machine_rank": 0,
        "main_process_port": 29500,
        "rdzv_backend": "c10d",
        "same_network": True,
        "main_training_function": "main",
    }
    if sharded:
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": c.zero_stage == 3,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": c.recompute != "none",
        }
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": c.dp,
            "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": c.tp,
            "parallelism_config_cp_size": c.cp,
        }
    lines = [f"# {line}" for line in header_lines(plan, "Accelerate", gaps, priced)]
    if plan.num_nodes > 1:
        lines.append("# on each node: set machine_rank and main_process_ip (the first node)")
    lines += _yaml(config)
    return Exported("accelerate", "accelerate.yaml", "\n".join(lines) + "\n", tuple(gaps))


def _yaml(mapping: dict[str, object], indent: str = "") -> list[str]:
    """A block mapping of scalars and one nested level: the subset Accelerate's files use
    (written here so that autopar needs no YAML writer)."""
    out = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _yaml(value, indent + "  ")
        elif isinstance(value, bool):
            out.append(f"{indent}{key}: {'true' if value else 'false'}")
        else:
            out.append(f"{indent}{key}: {value}")
    return out
