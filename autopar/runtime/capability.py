"""What the runtime can run, as bounds on the planner's search space and as refusals.

In: the model and the `SpaceLimits` its trace and cluster gave (the search), or one
`ParallelConfig` (`evaluate`). Out: the limits with the parallelism the runtime cannot apply to
this model taken out, and a note for each (the plan carries them); for one config, each way the
runtime would refuse it or run it otherwise than priced, naming the model part and why:

    pipeline stages     `autopar.runtime.parts` cuts the models it knows; any other whose
                        blocks are the items of one nn.ModuleList is cut from its traced graph
                        (`autopar.runtime.traced_stages`), with tp = cp = ep = 1 (its stages
                        hold aten ops, not the modules those split), unless its code makes
                        a constant of the graph from meta tensors (Falcon's); else pp = 1
    tensor parallelism  `tensor_parallel.unsplit_block` finds a block it would leave
                        replicated while the estimate prices it sharded (linears it knows by
                        name, and the others the trace made column/row parallel where
                        `split_check` finds the model's code computes on their slices), or
                        `split_check.whole_width_norm` a q/k norm over a whole column-parallel
                        output (OLMo2's) -> tp = 1
    sequence par.       needs a column/row pair in every block and every block parameter
                        taken by a style (routers and experts are: their gradients are summed
                        over tp; MLA's down-projections are not: `tensor_parallel.tp_plan`)
                        -> else tensor parallelism without it
    context parallelism a Hugging Face model's own code, run on fake tensors
                        (`attention_check`): every block attends through transformers'
                        attention interface under a causal mask, or a sliding window the
                        call passes, or calls torch's SDPA itself under transformers' causal
                        mask (Falcon's); no soft-capped scores (Gemma 2's), no chunked mask
                        (Llama 4's), no token mixing outside attention (Mamba2's); the zoo's
                        models by their `parts` entry -> else cp = 1
    expert parallelism  needs MoE blocks with a token dispatch (`expert_parallel`: the zoo's,
                        and transformers' stacked experts, `hf_experts`) -> else ep = 1
    expert tensor par.  etp = tp splits each expert's width (`expert_tensor_parallel`): the
                        zoo's SwiGLU experts and transformers' stacks of Mixtral's layout,
                        their width divisible by tp -> else etp = 1
    torch.compile       the "autopar-compile" stack compiles each block: with data, sharded
                        and pipeline parallelism and recompute only, tp = cp = ep = 1 (a
                        compiled DTensor block fails in backward under torch 2.13)
    MXFP8               torchao's MXFP8 linear scales blocks of 32 tokens in the weight
                        gradient's GEMM: each rank's share of a sequence (seq / cp) a
                        multiple of 32 (`token_multiple`; a dispatched expert's rows are
                        padded to whole blocks, `low_precision.mx_padded`); under tp its
                        linears run on their shards (`low_precision.run_mxfp8_locally`):
                        only plain column/row splits, each shard's width a multiple of 32
                        (`mxfp8_tp_width`) -> else tp = 1; etp splits each expert's width
                        into slices of a multiple of 32 -> else etp = 1

Invariant: the search offers no config the generated program would refuse or run otherwise
than priced, for these axes; `evaluate` refuses the same configs with the same reasons. Both
hold for autopar's own stack (`own_runtime`): a plan priced for another stack (Megatron,
torchtitan) is exported to that framework, which runs what it runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.config.precision import RECIPES, recipe_of, supported_recipes
from autopar.errors import ConfigError
from autopar.estimate.stacks import load_stack, stack_names
from autopar.estimate.tables import tensor_parallel_roles
from autopar.hardware.profile import HardwareProfile
from autopar.runtime.attention_check import attention_dropout, cp_refusal, own_code_refusal
from autopar.runtime.expert_parallel import is_moe_block
from autopar.runtime.expert_tensor_parallel import expert_split_problem
from autopar.runtime.hf_experts import is_hf_experts
from autopar.runtime.low_precision import (
    MX_BLOCK,
    block_linears,
    covered_linears,
    runnable,
)
from autopar.runtime.parts import has_parts, sliding_window
from autopar.runtime.split_check import (
    CheckedRoles,
    checked_roles,
    whole_width_norm,
    wide_norm_refusal,
)
from autopar.runtime.tensor_parallel import find_blocks, left_whole, tp_plan, unsplit_block
from autopar.runtime.traced_stages import NO_LOSS_SLOT, traced_blocks, why_no_block_list
from autopar.solve.space import SpaceLimits
from autopar.tracing import ModelGraph


def traced_roles(model: nn.Module, graph: ModelGraph) -> CheckedRoles:
    """The block linears outside the Megatron names that the runtime may split as the trace
    priced them (`Plan.tensor_parallel_roles`), why it may not split the others ("" when
    none is held back), and why the model's code fails with its projections split at all:
    `split_check.checked_roles` on the trace's inputs, on meta."""
    inputs = _meta_inputs(graph)
    traced = tensor_parallel_roles(graph)
    found = checked_roles(model, traced, inputs, _cut_outputs(graph))
    return found._replace(priced=tuple(traced))


def attention_refusal(model: nn.Module, graph: ModelGraph) -> str:
    """Why context parallelism would not compute ``model``'s attention, or "": for a model
    with a Hugging Face config, `attention_check.cp_refusal` on the trace's inputs (its own
    code's attention calls and masks); for another, "" where autopar's `parts` cut it (the
    zoo's attention modules take an `attention_fn`), else `attention_check.own_code_refusal`."""
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        own = "" if has_parts(model) else own_code_refusal(model, _meta_inputs(graph))
        name = type(model).__name__
        return f"autopar's runtime cannot run context parallelism on {name}: {own}" if own else ""
    why = cp_refusal(model, _meta_inputs(graph))
    return (
        f"autopar's runtime computes causal attention under context parallelism: {why}"
        if why
        else ""
    )


def _meta_inputs(graph: ModelGraph) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.empty(node.shapes[0], dtype=getattr(torch, node.dtypes[0]), device="meta")
        for node in graph.nodes.values()
        if node.kind == "input" and node.shapes
    )


# the aten ops that cut a tensor into pieces, as the trace records them
_CUT_OPS = frozenset(
    f"aten.{op}" for op in ("split.Tensor", "split_with_sizes.default", "slice.Tensor",
                            "chunk.default", "narrow.default", "unbind.int",
                            "tensor_split.indices", "tensor_split.sections")
)  # fmt: skip


def _cut_outputs(graph: ModelGraph) -> frozenset[str]:
    """Module paths of the weight matmuls whose output the trace shows cut along its last
    dimension right where the module made it (GPT-2's c_attn split, Phi-3's qkv_proj sliced):
    the named projections `checked_roles` must run the model to see the cuts of."""
    last: dict[str, str] = {}  # module path -> the name of its last node, its output
    for name, node in graph.nodes.items():
        if node.kind == "call" and node.module_path:
            last[node.module_path] = name
    out = set()
    for node in graph.nodes.values():
        if node.op not in _CUT_OPS or not node.inputs:
            continue
        source = graph.nodes.get(node.inputs[0])
        if source is None or last.get(source.module_path) != source.name or not source.shapes:
            continue
        whole = source.shapes[0]
        if any(len(s) == len(whole) and s[-1] < whole[-1] for s in node.shapes):
            out.add(source.module_path)
    return frozenset(out)


def _pipeline_cut(model: nn.Module, num_blocks: int, meta_constants: tuple[str, ...] = ()) -> str:
    """ "parts", "traced", or why neither cuts ``model`` (whose trace found ``num_blocks``
    and `ModelGraph.meta_constants`)."""
    if has_parts(model):
        return "parts"
    found = traced_blocks(model)
    name = type(model).__name__
    if found is None:
        return f"autopar's runtime cannot cut {name} into pipeline stages: " + why_no_block_list(
            model
        )
    path, n = found
    if n != num_blocks:
        return (
            f"autopar's runtime cannot cut {name} into pipeline stages: {path} holds {n} "
            f"blocks but its trace has {num_blocks} repeated layers"
        )
    if meta_constants:
        more = f" and {len(meta_constants) - 1} more" if len(meta_constants) > 1 else ""
        return (
            f"autopar's runtime cannot cut {name} into pipeline stages from its traced graph: "
            f"its code makes {meta_constants[0]}{more} from the meta device's tensors, a "
            "constant of the graph with no value to rebuild it from (a ModelParts entry, "
            "autopar.runtime.parts, cuts it by its modules)"
        )
    return "traced"


# the stack whose generated program compiles each block (`TrainOptions.compile`)
COMPILED_STACK = "autopar-compile"


def token_multiple(precision: str) -> int:
    """What each rank's share of a sequence must be a multiple of for ``precision``'s GEMMs
    in autopar's runtime: `MX_BLOCK` for MXFP8, else 1."""
    recipe = recipe_of(precision)
    return MX_BLOCK if recipe is not None and recipe.gemm_dtype == "mxfp8" else 1


def mxfp8_tp_width(model: nn.Module, roles: dict[str, str]) -> tuple[int, str]:
    """(the greatest common divisor of the widths tensor parallelism splits in ``model``'s
    MXFP8 linears, why tp > 1 cannot run them or ""): each tp shard's width must be a multiple
    of `MX_BLOCK`; a fused projection's strided split does not run on its shards."""
    from math import gcd

    blocks = find_blocks(model)
    plans = [tp_plan(model, ParallelConfig(tp=2), roles=roles)]
    with contextlib.suppress(ValueError):  # a model sequence parallelism cannot split
        plans.append(tp_plan(model, ParallelConfig(tp=2, sequence_parallel=True), roles=roles))
    width = 0
    for path in covered_linears(blocks, RECIPES["mxfp8"]):
        linear = model.get_submodule(path)
        for plan in plans:
            style = plan.get(path)
            if style is None:
                continue
            if style in ("colwise", "colwise_gather"):
                width = gcd(width, linear.out_features)
            elif style in ("rowwise", "rowwise_to_seq"):
                width = gcd(width, linear.in_features)
            else:
                return 0, (
                    f"{path} would take the {style!r} style, and only plain column/row splits "
                    "run torchao's MXFP8 GEMMs on their shards"
                )
    return width, ""


def recipe_problem(precision: str, seq_len: int) -> str:
    """Why autopar's runtime trains no config of a model with sequences of ``seq_len`` tokens
    in ``precision``, or "" when some may."""
    multiple = token_multiple(precision)
    if seq_len and seq_len % multiple:
        return (
            f"precision {precision!r} needs sequences of a multiple of {multiple} tokens "
            f"(torchao's MXFP8 scale blocks run along them in the weight gradient's GEMM); "
            f"this one has {seq_len}"
        )
    return ""


def recipe_coverage(model: nn.Module, precision: str) -> str:
    """What the plan should say when autopar's runtime keeps some of the blocks' linears out of
    ``precision``'s recipe (transformers' Conv1D, those with a dimension its GEMMs do not
    take, or, for MXFP8, a bias; the estimate prices them in BF16 too), else ""."""
    recipe = recipe_of(precision)
    if recipe is None or not runnable(recipe):
        return ""
    blocks = find_blocks(model)
    every = block_linears(blocks, recipe)
    kept = len(every) - len(covered_linears(blocks, recipe))
    if not kept:
        return ""
    why = {"mxfp8": "a bias or a dimension not a multiple of 32"}.get(
        recipe.gemm_dtype, "a dimension not a multiple of 16"
    )
    return (
        f"{precision}: autopar's runtime keeps {kept} of the blocks' {len(every)} linear layers "
        f"in BF16 (transformers' Conv1D, {why}), and prices them so: FP8 buys less here"
    )


def runtime_limits(
    model: nn.Module,
    limits: SpaceLimits,
    stack: str = "autopar",
    roles: tuple[dict[str, str], str] = ({}, ""),
    precision: str = "bf16",
    attention: str | None = None,
    meta_constants: tuple[str, ...] = (),
) -> tuple[SpaceLimits, list[str]]:
    """``limits`` bounded by what the runtime can do for ``model`` when ``stack`` runs it in
    ``precision``, and why (module docstring). ``roles``: `traced_roles`.

    Raises:
        ConfigError: the runtime trains no config of this model in ``precision``.
    """
    notes = []
    name = type(model).__name__
    if why := recipe_problem(precision, limits.seq_len):
        raise ConfigError(f"{why}: plan another precision, or export the plan")
    if coverage := recipe_coverage(model, precision):
        notes.append(coverage)
    if (multiple := token_multiple(precision)) > 1:
        width, why = mxfp8_tp_width(model, roles[0])
        limits = replace(limits, token_multiple=multiple, tp_width=width)
        if why:
            limits = replace(limits, max_tp=1)
            notes.append(f"no tensor-parallel plans in {precision}: {why}")
    if stack == COMPILED_STACK:  # save_on_cpu's hooks are not compiled (runtime_problems)
        limits = replace(limits, offload=False)
    if limits.max_cp > 1 and (p := attention_dropout(model)):
        limits = replace(limits, cp_ring=False)
        notes.append(f"no ring context parallelism: {name} drops attention probabilities (p={p})")
    if stack == COMPILED_STACK and (limits.max_tp != 1 or limits.max_cp > 1 or limits.num_experts):
        limits = replace(limits, max_tp=1, max_cp=1, num_experts=0)
        notes.append(f"no tensor-, context- or expert-parallel plans: {_no_compiled_split()}")
    cut = _pipeline_cut(model, limits.num_blocks, meta_constants)
    if cut == "traced":
        limits = replace(limits, pipeline_alone=True)
        notes.append(
            f"pipeline plans cut {name} from its traced graph (no autopar.runtime.parts "
            "entry): with tp = cp = ep = 1"
        )
    elif cut != "parts":
        limits = replace(limits, max_pp=1)
        notes.append(f"no pipeline plans: {cut}")
    if limits.num_experts and not _dispatches_experts(model):
        limits = replace(limits, num_experts=0)
        notes.append(f"no expert-parallel plans: {_no_ep(name)}")
    if limits.num_experts:
        width, why = expert_width(model)
        if why:
            notes.append(f"no expert tensor-parallel plans (etp = 1): {why}")
        limits = replace(limits, expert_width=width)
    if limits.max_cp > 1 and (why := _cp_problem(model, limits.seq_len, attention)):
        limits = replace(limits, max_cp=1)
        notes.append(f"no context-parallel plans: {why}")
    if why := _tp_refusal(model, limits.num_blocks, roles):
        limits = replace(limits, max_tp=1)
        notes.append(f"no tensor-parallel plans: {why}")
    elif no_sp := _no_sp(model, roles[0]):
        limits = replace(limits, no_sequence_parallel=True)
        notes.append(f"tensor parallelism without sequence parallelism: {no_sp}")
    return limits, notes


def runtime_problems(
    model: nn.Module,
    config: ParallelConfig,
    num_blocks: int,
    stack: str = "autopar",
    roles: tuple[dict[str, str], str] = ({}, ""),
    seq_len: int = 0,
    precision: str = "bf16",
    attention: str | None = None,
    meta_constants: tuple[str, ...] = (),
) -> list[str]:
    """Every way autopar's runtime would refuse ``config`` for ``model`` (whose trace found
    ``num_blocks`` repeated layers, of ``seq_len`` tokens) when ``stack`` runs it in
    ``precision``, or run it otherwise than priced; empty when it runs. ``roles``:
    `traced_roles`. (The sequence's and the tp shards' split into MXFP8's blocks are
    `shape_problems`'.)"""
    out = []
    name = type(model).__name__
    if why := recipe_problem(precision, seq_len):
        out.append(why)
    mxfp8 = token_multiple(precision) > 1  # tp on plain splits (widths: shape_problems)
    if mxfp8 and config.tp > 1 and (why := mxfp8_tp_width(model, roles[0])[1]):
        out.append(f"tp={config.tp} in {precision}: {why}")
    if stack == COMPILED_STACK and max(config.tp, config.cp, config.ep) > 1:
        out.append(
            f"tp={config.tp} cp={config.cp} ep={config.ep} on the {stack} stack: "
            + _no_compiled_split()
        )
    if config.offload_layers and stack == COMPILED_STACK:
        out.append(
            f"offload_layers={config.offload_layers} on the {stack} stack: torch.compile "
            "would trace save_on_cpu's saved-tensor hooks into each block; offload on the "
            "eager stack (autopar)"
        )
    if config.pp > 1:
        cut = _pipeline_cut(model, num_blocks, meta_constants)
        if cut == "traced" and max(config.tp, config.cp, config.ep) > 1:
            out.append(
                f"pp={config.pp} cuts {name} from its traced graph, whose stages hold aten ops "
                "rather than the modules tensor, context and expert parallelism split: with "
                f"pp > 1 it runs tp = cp = ep = 1 (here tp={config.tp} cp={config.cp} "
                f"ep={config.ep})"
            )
        elif cut not in ("parts", "traced"):
            out.append(f"pp={config.pp}: {cut}")
        if cut == "traced" and "loss" in config.pipeline_slots:
            out.append(NO_LOSS_SLOT.format(name=name))
    if config.cp > 1 and (why := _cp_problem(model, seq_len, attention)):
        out.append(f"cp={config.cp}: {why}")
    if config.cp_attention == "ring" and (p := attention_dropout(model)):
        out.append(
            f"cp_attention=ring: {type(model).__name__} drops attention probabilities (p={p}), "
            "which the ring's blockwise softmax does not (context_parallel.ring_attention); "
            "cp_attention=all_gather computes it"
        )
    if config.ep > 1 and not _dispatches_experts(model):
        out.append(f"ep={config.ep}: {_no_ep(name)}")
    if config.recompute_modules:
        out.append(f"recompute_modules={'+'.join(config.recompute_modules)}: autopar's runtime "
                   "recomputes whole blocks (full) or by torch's op policy (selective); "
                   "Megatron-Core recomputes named parts of a block (stack megatron-core or "
                   "megatron-bridge; autopar export --to megatron)")  # fmt: skip
    if config.ep_folds_over_tp:
        out.append(
            f"ep={config.ep} folds over the tp ranks too (dp x fsdp x cp = "
            f"{config.dp * config.fsdp * config.cp} does not hold it): autopar's runtime folds "
            "expert parallelism over the ranks holding different tokens only; Megatron-Core "
            "runs this layout (MoE parallel folding, stack megatron-core; autopar export --to "
            "megatron)"
        )
    if config.etp > 1:
        width, why = expert_width(model)
        if why:
            out.append(f"etp={config.etp}: {why}")
        elif width % config.etp:
            out.append(
                f"etp={config.etp} does not divide the experts' intermediate width {width} of "
                f"{name}"
            )
        elif mxfp8 and width % (config.etp * MX_BLOCK):
            out.append(
                f"etp={config.etp} in {precision} slices the experts' intermediate width "
                f"{width} of {name} into {width // config.etp}, not a multiple of {MX_BLOCK} "
                "(torchao's MXFP8 blocks)"
            )
    if config.tp > 1 and (why := _tp_refusal(model, num_blocks, roles)):
        out.append(f"tp={config.tp}: {why}")
    elif config.tp > 1 and config.sequence_parallel and (no_sp := _no_sp(model, roles[0])):
        out.append(f"sequence_parallel: {no_sp}")
    return out


def _no_compiled_split() -> str:
    return (
        "autopar's runtime compiles blocks with data, sharded and pipeline parallelism only "
        "(a compiled tensor-parallel block fails in backward under torch 2.13); plan for the "
        "autopar stack to split them"
    )


def _no_sp(model: nn.Module, roles: dict[str, str]) -> str:
    """Why the runtime cannot run sequence parallelism on ``model`` (`tp_plan`'s reason), or
    ""."""
    try:
        tp_plan(model, ParallelConfig(tp=2, sequence_parallel=True), roles=roles)
    except ValueError as e:
        return f"autopar's runtime, for {type(model).__name__}: {e}"
    return ""


def expert_width(model: nn.Module) -> tuple[int, str]:
    """(the experts' intermediate width, "") where `expert_tensor_parallel` can split every
    MoE layer of ``model`` (the smallest width where they differ), else (0, why not)."""
    widths = []
    for path, module in model.named_modules():
        if is_hf_experts(module):
            if why := expert_split_problem(module):
                return 0, f"{path} ({type(module).__name__}): {why}"
            widths.append(module.down_proj.shape[-1])
        elif is_moe_block(module):
            for key, expert in module.experts.named_children():
                down = getattr(expert, "down_proj", None)
                parts = [getattr(expert, n, None) for n in ("gate_proj", "up_proj")] + [down]
                if not all(isinstance(m, nn.Linear) and m.bias is None for m in parts):
                    return 0, (
                        f"{path}.experts.{key} ({type(expert).__name__}) is not a SwiGLU of "
                        "bias-free gate_proj, up_proj and down_proj linears"
                    )
                widths.append(down.in_features)
    if not widths:
        return 0, f"{type(model).__name__} has no MoE layer autopar's runtime dispatches"
    return min(widths), ""


def _dispatches_experts(model: nn.Module) -> bool:
    """Whether ``model`` has MoE blocks `expert_parallel` can share out."""
    return any(is_moe_block(m) for m in model.modules())


def _no_ep(name: str) -> str:
    return (
        "autopar's runtime dispatches tokens to experts over ranks for its own MoE blocks "
        "(autopar.models.moe) and Hugging Face expert stacks (experts stacked on the first "
        f"dimension, forward(hidden_states, top_k_index, top_k_weights)), not {name}'s, whose "
        "experts it would run replicated"
    )


def _cp_problem(model: nn.Module, seq_len: int, attention: str | None) -> str:
    """``attention`` (`attention_refusal`'s finding), or when the caller has none, the rule
    from the model's class and config alone."""
    if attention is not None:
        return attention
    if not has_parts(model):
        return _no_cp(type(model).__name__)
    return _cp_attention(model, seq_len)


def _cp_attention(model: nn.Module, seq_len: int) -> str:
    """Why autopar's context-parallel attention (whole causal softmax attention) would not
    compute ``model``'s, or "": a sliding window narrower than the sequence (Mistral's, Phi-3's,
    Gemma 2's), scores soft-capped before the softmax (Gemma 2's)."""
    name = type(model).__name__
    window = sliding_window(model)
    cap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
    if window and window < seq_len:
        why = f"attends within a sliding window of {window} tokens, narrower than its {seq_len}"
    elif cap:
        why = f"soft-caps its attention scores (at {cap}) before the softmax"
    else:
        return ""
    return (
        "autopar's runtime computes whole causal attention under context parallelism, and "
        f"{name} {why}"
    )


def _no_cp(name: str) -> str:
    return (
        f"autopar's runtime runs context parallelism on models it can call at a sequence "
        f"shard's positions (autopar.runtime.parts: its zoo and Hugging Face decoder "
        f"families), not {name}"
    )


def _tp_refusal(model: nn.Module, num_blocks: int, roles: tuple) -> str:
    """Why autopar's runtime would not split ``model`` over tp as the estimate prices it, or
    "": a block left whole, a q/k norm over a whole projection's output, code that fails with
    the projections it splits by name, or a projection priced split left whole."""
    name = type(model).__name__
    if unsplit := unsplit_block(model, num_blocks, roles[0]):
        return _no_tp(name, unsplit, roles[1])
    if wide := whole_width_norm(model):
        return wide_norm_refusal(wide)
    if fails := _unsplittable(roles):
        return _code_fails(name, fails)
    if left := left_whole(model, getattr(roles, "priced", ()), roles[0]):
        what = f"{left} whole, in {name}'s blocks that it splits otherwise, while the estimate"
        return _held_back(f"{what} prices it sharded", roles[1])
    return ""


def _unsplittable(roles: tuple) -> str:
    """`CheckedRoles.unsplittable` ("" for a plain (roles, why) pair)."""
    return getattr(roles, "unsplittable", "")


def _splittable(why: str) -> str:
    """What would make code that fails at 1/tp of its features split ("" for another why)."""
    return (
        "; the runtime hands that code each rank's share of the heads: a head count taken "
        "from the tensor (view(..., -1, head_dim)) splits, one read from the config or a "
        "weight over every head ([heads, head_dim], a q/k norm's) would have to follow it"
    ) if why.startswith("its code fails with") else ""  # fmt: skip


def _code_fails(name: str, why: str) -> str:
    what = f"{name}'s own code does not run with its projections split over tp ({why})"
    return what + _splittable(why)


def _no_tp(name: str, block: str, why: str = "") -> str:
    return _held_back(
        f"{name}'s blocks replicated, {block} first (it splits linear projections it can pair "
        "column/row), while the estimate prices them sharded",
        why,
    )


def _held_back(what: str, why: str) -> str:
    """The runtime would leave ``what``, and ``why`` it holds the trace's pairs back."""
    return (
        f"autopar's runtime would leave {what}"
        + (f"; it does not split the projections the trace pairs because {why}" if why else "")
        + _splittable(why)
    )


def precision_candidates(profile: HardwareProfile, stack: str) -> tuple[list[str], str]:
    """What ``precision="auto"`` chooses among on ``profile`` for ``stack``: BF16 and every
    recipe the device has tensor cores for and the stack trains (for autopar's runtime, those
    torchao trains; for a shipped stack, its [precision] recipes), and why there is nothing
    else where there is not."""
    peaks = profile.device.peak_flops_per_s
    on_device = supported_recipes(profile.kind, peaks)
    if own_runtime(stack):
        recipes = [r for r in on_device if runnable(r)]
    else:
        trains = stack_recipes(stack)
        recipes = [r for r in on_device if trains is None or r.name in trains]
    names = ["bf16", *(r.name for r in recipes)]
    if recipes:
        return names, ""
    if profile.kind != "gpu":
        why = f"{profile.name} is a {profile.kind.upper()} profile: no FP8 training GEMMs"
    elif not on_device:
        why = f"{profile.name} ({profile.device.name}) has no FP8 tensor cores"
    else:
        said = ", ".join(r.name for r in on_device)
        why = f"the {stack} stack trains none of the recipes {profile.device.name} runs ({said})"
    return names, why


def stack_recipes(stack: str) -> tuple[str, ...] | None:
    """The recipes a shipped ``stack`` trains (its [precision] table), or None: every one (a
    stack without the table, or a stack file of one's own, which is priced as given)."""
    if stack not in stack_names():
        return None
    return load_stack(stack).recipes


def own_runtime(stack: str) -> bool:
    """Whether ``stack`` is what autopar's generated programs run: its own, or values of
    one's own (`CostOptions.stack` ""), or its own under torch.compile."""
    return stack in ("autopar", "", COMPILED_STACK)
