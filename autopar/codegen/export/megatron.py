"""A plan as Megatron-LM / NeMo command-line arguments: a bash array for pretrain_gpt.py.

    tp, pp, cp, ep        --tensor-, --pipeline-, --context-, --expert-model-parallel-size;
                          Megatron's data-parallel size is what is left: dp x fsdp
    cp_attention          --cp-comm-type allgather, or p2p for the ring
    async_tp              --tp-comm-overlap (TransformerEngine's userbuffers)
    etp                   --expert-tensor-parallel-size, where ep or etp > 1 (Megatron's
                          default is tp: a plan's etp = 1 must say so)
    zero_stage 1-2        --use-distributed-optimizer (optimizer state sharded over the data-
                          parallel ranks; with dp > 1 and fsdp > 1, one instance per replica:
                          --num-distributed-optimizer-instances dp)
    zero_stage 3          --use-torch-fsdp2 (not with pp or ep: there the distributed optimizer)
    schedule              1F1B; interleaved with --num-virtual-stages-per-pipeline-rank
    pipeline_slots        --account-for-embedding-in-pipeline-split, ...-loss-... (the same
                          even split of blocks and slots)
    recompute=full:k      --recompute-granularity full --recompute-method block
                          --recompute-num-layers k (the first k blocks of each chunk: the same
                          rule as autopar's); every block: --recompute-method uniform, 1
    recompute=selective   --recompute-granularity selective (core attention), with
                          recompute_modules --recompute-modules and their names
    offload_layers k      --cpu-offloading-num-layers k (TransformerEngine's CPU offload)
    the model's shape     --num-layers, --hidden-size, ... from its config, when it is a decoder

Option names and choices are those of Megatron-LM's own parser (tests check every argument
against it: tests/data/megatron_lm_options.json).
"""

from __future__ import annotations

import shlex

from autopar.codegen.export.common import (
    Exported,
    ModelShape,
    Priced,
    checkpoint_interval,
    header_lines,
)
from autopar.config.precision import recipe_of
from autopar.plan.types import Plan

# Megatron's rank order, innermost first (tp-cp-ep-dp-pp): autopar's default order
_MEGATRON_ORDER = ("tp", "cp", "fsdp", "dp")


def megatron_args(plan: Plan, shape: ModelShape | None, gaps: list[str]) -> list[str]:
    """The arguments, as argv tokens; what Megatron cannot express appended to ``gaps``."""
    c = plan.config
    args = [
        *("--tensor-model-parallel-size", str(c.tp)),
        *("--pipeline-model-parallel-size", str(c.pp)),
        *("--context-parallel-size", str(c.cp)),
        *("--expert-model-parallel-size", str(c.ep)),
        *("--micro-batch-size", str(c.micro_batch_size)),
        *("--global-batch-size", str(plan.global_batch_size)),
        *("--seq-length", str(plan.seq_len)),
    ]
    if c.sequence_parallel:
        args.append("--sequence-parallel")
    if c.cp > 1:  # Megatron's p2p is the ring; allgather gathers K and V as autopar's default
        args += ["--cp-comm-type", "p2p" if c.cp_attention == "ring" else "allgather"]
    if c.async_tp:  # TransformerEngine's userbuffers: TP GEMMs overlapped with their comms
        args.append("--tp-comm-overlap")
    if c.ep > 1 or c.etp > 1:
        args += ["--expert-tensor-parallel-size", str(c.etp)]
    if c.ep > 1 and not c.ep_folds_over_tp:  # a fold over tp is Megatron's own
        gaps.append(
            f"ep={c.ep}: Megatron folds the experts over its data x context ranks; the plan "
            "folds them over the data-parallel replicas. MoE arguments (--num-experts, "
            "--moe-router-topk) are the model's: add them"
        )
    args += _sharding(plan, shape, gaps)
    args += _schedule(plan, gaps)
    args += _recompute(plan, gaps)
    if c.offload_layers:  # TransformerEngine's CPU offload of the first k layers' activations
        args += ["--cpu-offloading-num-layers", str(c.offload_layers)]
    args += _precision(plan, gaps)
    if c.axis_order is not None and c.axis_order != _MEGATRON_ORDER:
        gaps.append(
            f"axis order {','.join(c.axis_order)}: Megatron orders ranks tp-cp-ep-dp-pp "
            "(innermost first)"
        )
    args += _model(plan, shape, gaps)
    args += ["--optimizer", "adam", "--clip-grad", "1.0", "--ckpt-format", "torch_dist"]
    interval = checkpoint_interval(plan, async_save=False)
    if interval:
        args += ["--save-interval", str(interval)]
    return args


def export_megatron(plan: Plan, shape: ModelShape | None, priced: Priced | None) -> Exported:
    gaps: list[str] = []
    args = megatron_args(plan, shape, gaps)
    lines = [f"# {line}" for line in header_lines(plan, "Megatron-LM", gaps, priced)]
    lines += [
        "# Use: source this file, then on every node",
        f"#   torchrun --nnodes {plan.num_nodes} --nproc-per-node "
        f'{plan.world_size // plan.num_nodes} pretrain_gpt.py "${{MEGATRON_ARGS[@]}}" \\',
        "#       --data-path ... --tokenizer-type ... --train-iters ... --lr ... --save ...",
        "MEGATRON_ARGS=(",
    ]
    pairs: list[str] = []
    for token in args:
        if token.startswith("--") or not pairs:
            pairs.append(token)
        else:
            pairs[-1] += " " + shlex.quote(token)
    lines += [f"    {pair}" for pair in pairs]
    lines.append(")")
    return Exported("megatron", "megatron_args.sh", "\n".join(lines) + "\n", tuple(gaps))


def _sharding(plan: Plan, shape: ModelShape | None, gaps: list[str]) -> list[str]:
    c = plan.config
    if not c.zero_stage:  # the distributed optimizer shards over dp x cp: cp alone too
        return []
    fsdp2_blocked = [why for cond, why in ((c.pp > 1, "pp"), (c.ep > 1, "ep")) if cond]
    tied = shape is not None and shape.tied_embeddings
    if c.zero_stage == 3 and not fsdp2_blocked and not tied and c.dp == 1:
        # FSDP2 needs untied weights: `_model` says so from the shape, or here without one
        return ["--use-torch-fsdp2", *(["--untie-embeddings-and-output-weights"] * (not shape))]
    out = ["--use-distributed-optimizer"]
    if c.dp > 1:
        out += ["--num-distributed-optimizer-instances", str(c.dp)]
    if c.zero_stage == 3:
        why = (
            f"Megatron's FSDP2 path refuses {' and '.join(fsdp2_blocked)}"
            if fsdp2_blocked
            else "the model ties its embedding and head, which Megatron's FSDP2 path refuses"
            if tied
            else "Megatron's FSDP2 path has no replicas (HSDP)"
        )
        gaps.append(
            f"zero_stage=3: {why}; the distributed optimizer keeps parameters and gradients "
            "whole on every rank (more memory than planned)"
        )
    elif c.zero_stage == 2:
        gaps.append(
            "zero_stage=2: Megatron's distributed optimizer keeps a whole gradient buffer on "
            "every rank (ZeRO-1 memory)"
        )
    return out


def _schedule(plan: Plan, gaps: list[str]) -> list[str]:
    c = plan.config
    if c.pp == 1:
        return []
    if c.schedule == "gpipe":
        gaps.append("schedule gpipe: Megatron runs 1F1B (the same bubble, fewer activations)")
    elif c.schedule in ("zero_bubble", "dualpipe_v"):
        gaps.append(
            f"schedule {c.schedule}: Megatron-LM runs 1F1B or interleaved 1F1B; "
            + ("interleaved" if c.virtual_stages > 1 else "1F1B")
            + " set (a larger bubble than planned)"
        )
    out = []
    if c.virtual_stages > 1:
        out += ["--num-virtual-stages-per-pipeline-rank", str(c.virtual_stages)]
    for slot in c.pipeline_slots:
        out.append(f"--account-for-{slot}-in-pipeline-split")
    return out


def _recompute(plan: Plan, gaps: list[str]) -> list[str]:
    c = plan.config
    if c.recompute == "none":
        return []
    if c.recompute == "full":
        layers = c.recompute_layers
        method = ["block", str(layers)] if layers else ["uniform", "1"]
        return [
            *("--recompute-granularity", "full"),
            *("--recompute-method", method[0]),
            *("--recompute-num-layers", method[1]),
        ]
    if c.recompute_layers is not None:
        gaps.append(
            f"recompute={c.recompute_text}: Megatron's selective recompute covers every block"
        )
    if c.recompute_modules:  # the parts of each block it re-runs
        return ["--recompute-granularity", "selective",
                "--recompute-modules", *c.recompute_modules]  # fmt: skip
    if c.recompute == "selective":
        gaps.append(
            "recompute=selective: autopar's is torch's op policy (keep the matmul and "
            "attention outputs); Megatron's selective re-runs core attention only (its "
            "default --recompute-modules), which keeps more"
        )
    return ["--recompute-granularity", "selective"]


def _model(plan: Plan, shape: ModelShape | None, gaps: list[str]) -> list[str]:
    if shape is None:
        gaps.append(
            f"the model's shape: {plan.model} has no decoder config autopar reads; add "
            "--num-layers, --hidden-size, --num-attention-heads and the rest"
        )
        return []
    out = [
        *("--num-layers", str(shape.num_layers)),
        *("--hidden-size", str(shape.hidden_size)),
        *("--ffn-hidden-size", str(shape.ffn_hidden_size)),
        *("--num-attention-heads", str(shape.num_heads)),
        *("--max-position-embeddings", str(max(shape.max_positions, plan.seq_len))),
        *("--vocab-size", str(shape.vocab_size)),
        *("--normalization", shape.norm),
    ]
    if shape.num_kv_heads != shape.num_heads:
        out += ["--group-query-attention", "--num-query-groups", str(shape.num_kv_heads)]
    if shape.gated_mlp:
        out.append("--swiglu")
    if shape.rope_theta is not None:
        out += ["--position-embedding-type", "rope", "--rotary-base", str(int(shape.rope_theta))]
    if not shape.tied_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if not shape.bias:
        out.append("--disable-bias-linear")
    return out


# autopar's recipe -> Megatron-LM's arguments (TransformerEngine runs them)
_MEGATRON_RECIPES = {
    "fp8-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "nvfp4": ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}


def _precision(plan: Plan, gaps: list[str]) -> list[str]:
    if plan.precision in ("bf16", "fp16"):
        return [f"--{plan.precision}"]
    recipe = recipe_of(plan.precision)
    if recipe is None:
        return []
    if recipe.name not in _MEGATRON_RECIPES:
        gaps.append(f"{recipe.name}: Megatron-LM has no such recipe; per-tensor FP8 set")
        return ["--bf16", *_MEGATRON_RECIPES["fp8-tensorwise"]]
    return ["--bf16", *_MEGATRON_RECIPES[recipe.name]]
