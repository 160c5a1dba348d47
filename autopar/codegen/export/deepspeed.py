"""A plan as a DeepSpeed config (the JSON `deepspeed.initialize(config=...)` reads; checked by
DeepSpeed's own `DeepSpeedConfig` in the tests).

    batch              train_batch_size = the global batch, train_micro_batch_size_per_gpu =
                       mbs, gradient_accumulation_steps = the plan's micro-batches
    fsdp, zero_stage   zero_optimization.stage (0 without fsdp)
    tp                 tensor_parallel.autotp_size (DeepSpeed's AutoTP training)
    cp                 sequence_parallel_size (DeepSpeed-Ulysses: all-to-all, not ring attention)
    precision          bf16 / fp16 enabled
    pp                 pipeline.stages: the model must be a deepspeed.pipe.PipelineModule

JSON has no comments: what DeepSpeed cannot express is listed under "autopar_comment", a key
DeepSpeed ignores.
"""

from __future__ import annotations

import json

from autopar.codegen.export.common import Exported, ModelShape, Priced, header_lines
from autopar.config.precision import recipe_of
from autopar.plan.types import Plan


def deepspeed_config(plan: Plan, gaps: list[str]) -> dict[str, object]:
    """The config as a dict; what DeepSpeed cannot express appended to ``gaps``."""
    c = plan.config
    config: dict[str, object] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
    }
    if plan.precision in ("bf16", "fp16"):
        config[plan.precision] = {"enabled": True}
    elif recipe_of(plan.precision) is not None:
        config["bf16"] = {"enabled": True}
        gaps.append(
            f"{plan.precision}: DeepSpeed's config has no FP8 recipe; bf16 set (convert the "
            "linears with TransformerEngine or torchao in the model to get FP8)"
        )
    stage = c.zero_stage if c.fsdp > 1 else 0
    if c.pp > 1 and stage > 1:  # DeepSpeed's pipeline engine refuses ZeRO stages 2-3
        gaps.append(
            f"zero_stage={stage} with pp={c.pp}: DeepSpeed's pipeline engine takes ZeRO stage "
            "0 or 1; stage 1 set (gradients and parameters whole on every rank: more memory)"
        )
        stage = 1
    config["zero_optimization"] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    if c.fsdp > 1 and c.dp > 1:
        gaps.append(
            f"dp={c.dp} x fsdp={c.fsdp} (hybrid sharding): ZeRO shards over all "
            f"{c.dp * c.fsdp} data-parallel ranks (less memory, more traffic across replicas)"
        )
    if c.tp > 1:
        config["tensor_parallel"] = {"autotp_size": c.tp}
        if c.sequence_parallel:
            gaps.append("sequence parallelism with tp: AutoTP shards the linear layers only")
    if c.cp > 1:
        config["sequence_parallel_size"] = c.cp
        gaps.append(
            f"cp={c.cp}: DeepSpeed-Ulysses splits the sequence with all-to-alls around "
            "attention (the model must wrap attention in DistributedAttention), not ring "
            "attention as planned"
        )
    if c.pp > 1:
        config["pipeline"] = {"stages": c.pp, "partition": "parameters"}
        gaps.append(
            f"pp={c.pp}: the model must be written as deepspeed.pipe.PipelineModule("
            f"num_stages={c.pp}); DeepSpeed runs 1F1B"
            + (f", not {c.schedule}" if c.schedule != "1f1b" else "")
        )
    if c.ep > 1:
        gaps.append(f"ep={c.ep}: set ep_size={c.ep} on the model's deepspeed.moe.layer.MoE layers")
    if c.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": c.tp > 1}
        gaps.append(
            f"recompute={c.recompute_text}: DeepSpeed recomputes what the model wraps in "
            "deepspeed.checkpointing.checkpoint (or HF's gradient_checkpointing_enable())"
        )
    return config


def export_deepspeed(plan: Plan, shape: ModelShape | None, priced: Priced | None) -> Exported:
    del shape  # DeepSpeed wraps the user's own model
    gaps: list[str] = []
    config = deepspeed_config(plan, gaps)
    notes = header_lines(plan, "DeepSpeed", gaps, priced)
    text = json.dumps({"autopar_comment": notes, **config}, indent=2) + "\n"
    return Exported("deepspeed", "deepspeed.json", text, tuple(gaps))
