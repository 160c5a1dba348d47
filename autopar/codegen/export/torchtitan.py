"""A plan as torchtitan's job TOML (torchtitan 0.2: `torchtitan.config.JobConfig`, loaded by its
ConfigManager with `--job.config_file`).

    dp, fsdp, cp, tp, pp, ep    [parallelism] data_parallel_replicate_degree, _shard_degree,
                                context_, tensor_, pipeline_, expert_parallel_degree
    etp                         expert_tensor_parallel_degree, where ep > 1 (torchtitan reads it
                                only then; with ep = 1 it splits the experts over tp)
    zero_stage                  fsdp_reshard_after_forward: 3 always, 1-2 never
    micro-batches               [training] local_batch_size (per data-parallel rank and step:
                                the pipeline's micro-batches x mbs with pp, else mbs) and
                                global_batch_size (torchtitan accumulates the rest);
                                pipeline_parallel_microbatch_size = mbs
    schedule                    pipeline_parallel_schedule (torch's schedule names)
    recompute                   [activation_checkpoint] mode none / selective (per op) / full
    checkpoint interval         [checkpoint] interval: the plan's goodput interval
"""

from __future__ import annotations

from autopar.codegen.export.common import (
    Exported,
    ModelShape,
    Priced,
    checkpoint_interval,
    header_lines,
    toml_value,
)
from autopar.config.parallel import DEFAULT_AXIS_ORDER
from autopar.config.precision import recipe_of
from autopar.plan.types import Plan

SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
    "dualpipe_v": "DualPipeV",
}
# autopar's Hugging Face presets that torchtitan defines as (model name, flavor)
MODELS = {
    "llama3-8b": ("llama3", "8B"),
    "llama3-70b": ("llama3", "70B"),
    "llama3-405b": ("llama3", "405B"),
    "deepseek-v3": ("deepseek_v3", "671B"),
}


def export_torchtitan(plan: Plan, shape: ModelShape | None, priced: Priced | None) -> Exported:
    del shape  # torchtitan builds its own model from [model] name and flavor
    c = plan.config
    gaps: list[str] = []
    sections: dict[str, dict[str, object]] = {
        "job": {"description": f"{plan.model} as planned by autopar ({c.as_text()})"}
    }
    name = (plan.model_source.kwargs.get("name") if plan.model_source else None) or ""
    if name in MODELS:
        sections["model"] = {"name": MODELS[name][0], "flavor": MODELS[name][1]}
    else:
        which = name or "a factory of your own"
        gaps.append(
            f"the model: torchtitan builds models it defines, and {plan.model} ({which}) is "
            "not one autopar maps; set [model] name and flavor"
        )
    if plan.precision == "fp16":
        gaps.append("fp16: torchtitan's mixed precision takes bfloat16 or float32; bfloat16 set")
    training: dict[str, object] = {
        "local_batch_size": c.micro_batch_size * (plan.num_microbatches if c.pp > 1 else 1),
        "global_batch_size": plan.global_batch_size,
        "seq_len": plan.seq_len,
        "max_norm": 1.0,
        "mixed_precision_param": "float32" if plan.precision == "fp32" else "bfloat16",
    }
    sections["training"] = training
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": c.dp,
        "data_parallel_shard_degree": c.fsdp,
        "tensor_parallel_degree": c.tp,
        "context_parallel_degree": c.cp,
        # torch's context parallel is always a ring; its K/V rotate by all-gather or by p2p
        "context_parallel_rotate_method": "alltoall" if c.cp_attention == "ring" else "allgather",
        "pipeline_parallel_degree": c.pp,
        "expert_parallel_degree": c.ep,
    }
    if c.ep > 1:  # torchtitan reads it only with ep > 1 (with ep = 1 TP splits the experts)
        parallelism["expert_tensor_parallel_degree"] = c.etp
        if c.etp == 1 and c.tp > 1 and not c.ep_folds_over_tp:
            gaps.append(
                f"etp=1 beside tp={c.tp}: torchtitan then folds ep over the tp ranks too; the "
                "plan keeps each expert whole on every tp rank, ep over the data ranks only"
            )
    elif c.etp == 1 and c.tp > 1 and plan.experts:
        gaps.append(
            f"tp={c.tp} with ep=1: torchtitan splits an MoE model's experts over tp (etp = tp); "
            "the plan keeps them whole on every tp rank (etp=1)"
        )
    if c.zero_stage:  # over fsdp, or over cp alone (torchtitan shards dp_shard x cp)
        parallelism["fsdp_reshard_after_forward"] = "always" if c.zero_stage == 3 else "never"
        if c.zero_stage == 1:
            gaps.append(
                "zero_stage=1: FSDP2 reduce-scatters gradients (ZeRO-2), so each rank keeps "
                "less gradient memory than planned"
            )
    if c.pp > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULES[c.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch_size
        if c.virtual_stages > 2:
            gaps.append(
                f"{c.virtual_stages} virtual stages: torchtitan's multi-stage schedules put 2 "
                "stages on a rank unless pipeline_parallel_layers_per_stage says otherwise "
                "(it counts the embedding and the head as layers): set it"
            )
        gaps.append(
            "stage boundaries: torchtitan cuts stages by its own rule (the embedding and the "
            "head counted as layers); the plan's stages hold "
            + ", ".join(f"{len(s.layers)}" for s in plan.stages)
            + " of autopar's layers"
        )
    if c.async_tp:  # torch's micro-pipelined TP: needs torch.compile on the blocks
        parallelism["enable_async_tensor_parallel"] = True
        sections.setdefault("compile", {})["enable"] = True
    if c.tp > 1 and not c.sequence_parallel:
        gaps.append(
            "tp without sequence parallelism: torchtitan always shards the norms' sequence "
            "with tp (less activation memory, the same communication volume)"
        )
    if c.ep_folds_over_tp and (c.fsdp * c.cp * c.tp) % c.ep:
        gaps.append(
            f"ep={c.ep}: torchtitan folds the experts over its dp_shard x cp x tp ranks; the "
            f"plan folds them over dp x fsdp x cp x tp (here dp={c.dp} fsdp={c.fsdp})"
        )
    elif c.ep > 1 and not c.ep_folds_over_tp and (c.cp > 1 or c.fsdp % c.ep):
        gaps.append(
            f"ep={c.ep}: torchtitan folds the experts over its dp_shard x cp ranks; the plan "
            f"folds them over the dp x fsdp data ranks (here dp={c.dp} fsdp={c.fsdp} cp={c.cp})"
        )
    if c.axis_order is not None and c.axis_order != DEFAULT_AXIS_ORDER:
        gaps.append(
            f"axis order {','.join(c.axis_order)}: torchtitan's mesh is always "
            "pp, dp_replicate, dp_shard, cp, tp (outermost first)"
        )
    sections["parallelism"] = parallelism
    sections["activation_checkpoint"] = _recompute(plan, gaps)
    _low_precision(plan, sections, gaps)
    checkpoint: dict[str, object] = {"enable": True, "folder": "checkpoint"}
    interval = checkpoint_interval(plan, async_save=False)
    if interval:
        checkpoint["interval"] = interval
    sections["checkpoint"] = checkpoint
    lines = [f"# {line}" for line in header_lines(plan, "torchtitan", gaps, priced)]
    if interval:
        lines.append(f"# [checkpoint] interval: the plan's goodput interval ({interval} steps)")
    for section, values in sections.items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
    return Exported("torchtitan", "torchtitan.toml", "\n".join(lines) + "\n", tuple(gaps))


def _recompute(plan: Plan, gaps: list[str]) -> dict[str, object]:
    c = plan.config
    if c.recompute == "none":
        return {"mode": "none"}
    if c.recompute_layers is not None:
        gaps.append(
            f"recompute={c.recompute_text}: torchtitan applies recompute to every block (or "
            f"every Nth), not the first {c.recompute_layers} of each chunk; every block set"
        )
    if c.recompute == "full":
        return {"mode": "full"}
    return {"mode": "selective", "selective_ac_option": "op"}


def _low_precision(plan: Plan, sections: dict[str, dict[str, object]], gaps: list[str]) -> None:
    """An FP8 / MXFP8 recipe as torchtitan's model converters (quantize.linear.*)."""
    recipe = recipe_of(plan.precision)
    if recipe is None:
        return
    model = sections.setdefault("model", {})
    if recipe.gemm_dtype == "fp8":
        model["converters"] = ["quantize.linear.float8"]
        tensorwise = recipe.torchao_recipe == "tensorwise"
        sections["quantize.linear.float8"] = {
            "recipe_name": recipe.torchao_recipe,
            "enable_fsdp_float8_all_gather": tensorwise and plan.config.zero_stage > 0,
            "precompute_float8_dynamic_scale_for_fsdp": tensorwise and plan.config.zero_stage > 0,
        }
    elif recipe.gemm_dtype == "mxfp8":
        model["converters"] = ["quantize.linear.mx"]
        sections["quantize.linear.mx"] = {"recipe_name": "mxfp8_cublas"}
    else:
        gaps.append(f"{recipe.name}: torchtitan has no converter for it; bfloat16 set")
        return
    sections.setdefault("compile", {})["enable"] = True
    gaps.append(
        f"{recipe.name}: torchtitan converts every aligned nn.Linear but the output head "
        "(filter_fqns to keep others in bfloat16), and needs torch.compile to fuse the casts "
        "(set: [compile] enable)"
    )
