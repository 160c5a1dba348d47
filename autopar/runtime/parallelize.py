"""Applying a plan to a model: pipeline cut, TP/SP, context and expert parallelism, recompute,
data parallelism -- the parallelised model the training loop (`autopar.runtime.trainer`) drives.

In: a full, seeded model (identical on every rank), the `RuntimeMesh`, the plan's
`ParallelConfig`, its placements or an explicit TP plan and, for pp > 1, a `PipelineSpec`.
Out: a `ParallelModel`: the module whose parameters the optimizer steps (pp > 1: this rank's
chunks under their original paths), its `DataParallel` record(s), the applied TP plan, and
the pipeline / context-parallel / expert-parallel records the loop calls.

Order (as torchtitan): pipeline split -> tensor/sequence parallel -> context parallel ->
expert parallel -> recompute -> activation offload (`offload`) -> torch.compile per block
(optional) -> FSDP2 / replication;
with pp > 1 everything after the split is applied per chunk (`autopar.runtime.pipeline` calls
back for each).

    compile  each block's forward compiled in place (`nn.Module.compile`: parameter names,
             checkpoints and FSDP units unchanged), inside recompute's checkpoint and under
             FSDP's hooks, as torchtitan's apply_compile; the "autopar-compile" stack prices it

    cp > 1   the model runs as one `stages.StageModule` (original paths), whose forward takes
             a sequence shard's global positions, so FSDP's root hooks wrap it as well; a
             model no `parts` entry cuts runs its own forward, handed the positions
             (`context_parallel.take_positions`)
    ep > 1   folded over the dp x fsdp x cp token ranks (cp innermost): the experts are left
             out of the dp average (`DataParallel.skip`) and the cp sum, and
             `expert_parallel` syncs them; with fsdp > 1 each MoE layer's experts are an FSDP2
             unit over the ranks holding the same experts

Public functions:
    PipelineSpec(num_microbatches, loss_fn, stage_layers=None, schedule=None, traced=None)
    ParallelModel
    parallelize_model(model, mesh, config, placements=None, tp=None, pipeline=None,
                      compile_blocks=False)
    pipeline_tp_plan(model, config, placements=None, stage_layers=None) -> TP plan, pp > 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from autopar.config import ParallelConfig
from autopar.runtime.data_parallel import DataParallel, apply_data_parallel, end_units
from autopar.runtime.mesh import RuntimeMesh
from autopar.runtime.offload import apply_offload
from autopar.runtime.parts import has_parts, parts_of
from autopar.runtime.pipeline import Pipeline, build_pipeline, layout_for
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.stages import build_stage_modules, even_layout
from autopar.runtime.startup.regions import HandSlice
from autopar.runtime.tensor_parallel import find_blocks, find_vocab_layers, tp_plan
from autopar.runtime.tp_apply import apply_tensor_parallel

if TYPE_CHECKING:
    from autopar.runtime.context_parallel import ContextParallel
    from autopar.runtime.expert_parallel import ExpertGroups, ExpertParallel


@dataclass(frozen=True)
class PipelineSpec:
    """What pp > 1 needs besides the config: micro-batches per step on this rank, the loss of
    one micro-batch, the plan's stage boundaries (`[s.layers for s in plan.stages]`; None:
    the even split), optionally a schedule overriding config.schedule (`pipeline.SCHEDULES`,
    e.g. "zbv") and, for a model cut from its traced graph, how the task calls it and one
    micro-batch of inputs (`pipeline.build_pipeline`'s ``traced``)."""

    num_microbatches: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    stage_layers: Sequence[Sequence[str]] | None = None
    schedule: str | None = None
    traced: tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]] | None = None


@dataclass
class ParallelModel:
    """A model on the plan's mesh, with what the loop needs to drive it.

    With pp > 1, `model` holds this rank's pipeline chunks under their original paths (the
    optimizer's, memory's and checkpoints' view), `pipeline` runs them, and there is one
    `DataParallel` per chunk (`data_parallels`; `data_parallel` is the first)."""

    model: nn.Module
    mesh: RuntimeMesh
    data_parallel: DataParallel
    tp_plan: dict[str, str]
    blocks: list[str]
    pipeline: Pipeline | None = None
    data_parallels: list[DataParallel] = field(default_factory=list)
    context_parallel: ContextParallel | None = None  # cp > 1: shards batches, sums gradients
    expert_parallel: ExpertParallel | None = None  # ep > 1: this rank's experts, their sync
    # etp > 1: the expert parameters sliced over tp (`expert_tensor_parallel`)
    split_experts: frozenset[str] = frozenset()
    # the parameters sliced by hand (ep's expert stacks, etp's widths): what each rank holds
    # of the whole tensor (`startup.regions`), in the order they were cut
    hand_slices: dict[str, tuple[HandSlice, ...]] = field(default_factory=dict)


class _Part(NamedTuple):
    """What `_parallelize_part` leaves the loop for one model or pipeline chunk."""

    data_parallel: DataParallel
    context: ContextParallel | None
    experts: ExpertParallel | None
    split_experts: frozenset[str]
    hand_slices: dict[str, tuple[HandSlice, ...]]


def parallelize_model(
    model: nn.Module,
    mesh: RuntimeMesh,
    config: ParallelConfig,
    placements: dict | None = None,
    tp: dict[str, str] | None = None,
    pipeline: PipelineSpec | None = None,
    compile_blocks: bool = False,
    param_dtype: torch.dtype | None = None,
) -> ParallelModel:
    """Apply the plan to a full, seeded ``model`` (identical on every rank), in place.

    ``tp`` is a TP plan (module -> style) as a generated program spells it out; without it the
    TP plan is derived from ``placements`` (`tensor_parallel.tp_plan`). With pp > 1 the model
    is cut into this rank's chunks (`autopar.runtime.pipeline`, ``pipeline`` required) and each
    chunk gets its own TP plan -- ``tp`` restricted to the chunk's modules, or
    `tp_plan(chunk)`, whose sequence-parallel ends are the chunk's first and last block (the
    hidden states between stages are whole sequences) -- recompute and data parallelism.
    ``compile_blocks``: compile each block with torch.compile (module docstring); refused
    (ValueError) with tp, cp or ep > 1, which compiled blocks do not run here.
    ``param_dtype``: what FSDP2 units gather and compute in (bf16 for mixed precision:
    `data_parallel.apply_data_parallel`); None keeps the parameters' dtype."""
    if compile_blocks and max(config.tp, config.cp, config.ep) > 1:
        raise ValueError(
            f"torch.compile of the blocks runs with data, sharded and pipeline parallelism "
            f"only, not tp={config.tp} cp={config.cp} ep={config.ep} (a compiled "
            "tensor-parallel block fails in backward under torch 2.13): run without --compile"
        )
    groups = _expert_groups(mesh, config)
    if config.pp > 1:
        return _parallelize_pipeline(
            model, mesh, config, placements, tp, pipeline, groups, compile_blocks, param_dtype
        )
    whole, callers = model, ()
    if config.cp > 1 and has_parts(model):  # one module running embed -> blocks -> head at
        # a shard's positions, original paths: FSDP's root hooks wrap the cp forward too
        layout = even_layout(parts_of(model).num_blocks(model), 1)
        model = build_stage_modules(model, layout, 0)[0]
    elif config.cp > 1:  # its own forward, handed the shard's positions
        from autopar.runtime.context_parallel import take_positions

        take_positions(model)
        callers = _sdpa_callers(model, config.cp)
    blocks = find_blocks(model)
    # the context-parallel loss reads whole-vocabulary logits: no vocabulary split with cp
    vocab = config.cp == 1
    plan = tp if tp is not None else tp_plan(model, config, placements, vocab_parallel=vocab)
    part = _parallelize_part(
        model, blocks, mesh, config, plan, groups, whole, compile_blocks, param_dtype,
        cp_callers=callers,
    )  # fmt: skip
    names = [p for p, _ in blocks]
    dp = part.data_parallel
    return ParallelModel(
        model,
        mesh,
        dp,
        plan,
        names,
        None,
        [dp],
        part.context,
        part.experts,
        part.split_experts,
        part.hand_slices,
    )


def _sdpa_callers(model: nn.Module, cp: int) -> tuple[type, ...]:
    """The classes of ``model``'s modules that call torch's SDPA themselves, where context
    parallelism must redirect those calls (a Hugging Face model no `parts` entry cuts);
    () where its attention goes through transformers' interface:
    `attention_check.attention_route` on a fake sample of token ids, as `evaluate` checked
    it; what it refuses, the runtime refuses too."""
    from autopar.runtime.attention_check import attention_route

    route = attention_route(model, (torch.zeros(1, 4 * cp, dtype=torch.long, device="meta"),))
    if not route.kind or route.why:
        raise ValueError(f"context parallelism: {route.why}")
    return route.callers


def _expert_groups(mesh: RuntimeMesh, config: ParallelConfig) -> ExpertGroups | None:
    """ep > 1: this rank's expert groups, ep folded over the dp x fsdp x cp token ranks
    (collective)."""
    if config.ep == 1:
        return None
    from autopar.runtime.expert_parallel import build_expert_groups  # see _parallelize_part

    ranks = mesh.mesh.mesh  # [pp, dp, fsdp, cp, tp], laid out in the plan's axis order
    return build_expert_groups(
        dist.get_world_size(),
        config.dp * config.fsdp * config.cp,
        config.tp,
        config.ep,
        ranks,
        mesh.mesh.device_type,
    )


def _parallelize_part(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    mesh: RuntimeMesh,
    config: ParallelConfig,
    plan: dict[str, str],
    expert_groups: ExpertGroups | None = None,
    whole: nn.Module | None = None,
    compile_blocks: bool = False,
    param_dtype: torch.dtype | None = None,
    ends: tuple[str | None, str | None] | None = None,
    cp_callers: tuple[type, ...] = (),
) -> _Part:
    """TP/SP, context and expert parallelism, recompute, data parallelism of a whole model or
    of one pipeline chunk (torchtitan's order), in place. ``whole``: the model ``model`` was
    cut from (a Hugging Face model's attention implementation is set on it)."""
    apply_tensor_parallel(model, mesh["tp"], plan)
    context = experts = None
    if config.cp > 1:  # attention over the cp ranks' sequence shards
        # imported here: the module is optional until the cp-ep helper's collectives land
        from autopar.runtime.context_parallel import CPOptions, apply_context_parallel

        options = CPOptions(kind=config.cp_attention)  # type: ignore[arg-type]
        context = apply_context_parallel(whole or model, mesh.group("cp"), options, cp_callers)
    if expert_groups is not None:  # ep > 1: this rank's experts, all-to-all token dispatch
        from autopar.runtime.expert_parallel import apply_expert_parallel

        experts = apply_expert_parallel(
            model, expert_groups, mesh.num_data_ranks, required=config.pp == 1
        )
    hand: dict[str, tuple[HandSlice, ...]] = {}
    split: frozenset[str] = frozenset()
    if experts is not None:  # a Hugging Face stack keeps its rank's experts under its name
        cut = HandSlice(0, 1, experts.rank, experts.size)
        hand.update({name: (cut,) for name in experts.stacked_names})
    if config.etp > 1:  # each expert's width over the tp ranks, around ep's dispatch
        from autopar.runtime.expert_tensor_parallel import apply_expert_tensor_parallel

        widths = apply_expert_tensor_parallel(
            model, mesh.group("tp"), config.sequence_parallel, required=config.pp == 1
        )
        for name, cut in widths.items():
            hand[name] = (*hand.get(name, ()), cut)
        split = frozenset(widths)
    apply_recompute(blocks, config.recompute, config.recompute_layers)  # first k: the plan's
    apply_offload(blocks, config.offload_layers)  # outside the checkpoint: its input moves too
    if compile_blocks:  # after recompute (the checkpoint is compiled), before FSDP's hooks
        for _, block in blocks:
            block.compile(dynamic=False)
    data_parallel = apply_data_parallel(
        model, blocks, mesh, config, experts, param_dtype, ends or end_units(model, blocks)
    )
    if experts is not None:  # experts are synced by expert_parallel, not averaged over dp
        data_parallel.skip = experts.expert_names
    return _Part(data_parallel, context, experts, split, hand)


def _parallelize_pipeline(
    model: nn.Module,
    mesh: RuntimeMesh,
    config: ParallelConfig,
    placements: dict | None,
    tp: dict[str, str] | None,
    spec: PipelineSpec | None,
    expert_groups: ExpertGroups | None = None,
    compile_blocks: bool = False,
    param_dtype: torch.dtype | None = None,
) -> ParallelModel:
    """pp > 1: this rank's chunks, each parallelised by `_parallelize_part`, and the schedule."""
    if spec is None:
        raise ValueError("pp > 1 needs a PipelineSpec (micro-batches, loss, stage boundaries)")
    plans: dict[str, str] = {}
    data_parallels: list[DataParallel] = []
    blocks: list[str] = []
    contexts: list[ContextParallel] = []  # one per chunk, all alike (the cp group)
    experts: list[ExpertParallel] = []  # one per chunk, each naming its own experts
    split: set[str] = set()  # etp > 1: the chunks' sliced expert parameters
    hand: dict[str, tuple[HandSlice, ...]] = {}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return contexts[0].loss(out, target) if contexts else spec.loss_fn(out, target)

    vocab = _vocab_layers(model, config)
    ends = end_units(model, find_blocks(model))  # FSDP2's, found on the whole model

    def per_chunk(chunk: nn.Module) -> None:
        named = chunk.named_blocks()
        held = {name for name, _ in chunk.named_modules()}
        if tp is not None:
            plan = {k: v for k, v in tp.items() if k in held}
        else:
            plan = _chunk_plan(chunk, config, placements, vocab)
        plans.update(plan)
        blocks.extend(p for p, _ in named)
        # the whole model for context parallelism: a Hugging Face model's attention
        # implementation is set on its config, which a chunk does not hold
        part = _parallelize_part(
            chunk, named, mesh, config, plan, expert_groups, model, compile_blocks, param_dtype,
            ends,
        )  # fmt: skip
        data_parallels.append(part.data_parallel)
        contexts.extend([part.context] if part.context is not None else [])
        experts.extend([part.experts] if part.experts is not None else [])
        split.update(part.split_experts)
        hand.update(part.hand_slices)

    pipe = build_pipeline(
        model,
        mesh,
        config,
        num_microbatches=spec.num_microbatches,
        loss_fn=loss_fn,
        stage_layers=spec.stage_layers,
        parallelize_chunk=per_chunk,
        schedule=spec.schedule,
        traced=spec.traced,
    )
    held = _merge_modules(list(pipe.chunks))
    context = contexts[0] if contexts else None
    expert = None
    if experts:  # one record for the rank's chunks: its parameters' names are the originals
        names = frozenset().union(*(e.expert_names for e in experts))
        stacked = frozenset().union(*(e.stacked_names for e in experts))
        blocks_ = sum(e.num_blocks for e in experts)
        expert = dataclasses.replace(
            experts[0], expert_names=names, num_blocks=blocks_, stacked_names=stacked
        )
    return ParallelModel(
        held,
        mesh,
        data_parallels[0],
        plans,
        blocks,
        pipe,
        data_parallels,
        context,
        expert,
        frozenset(split),
        hand,
    )


def pipeline_tp_plan(
    model: nn.Module,
    config: ParallelConfig,
    placements: dict | None = None,
    stage_layers: Sequence[Sequence[str]] | None = None,
    schedule: str | None = None,
    roles: dict[str, str] | None = None,
) -> dict[str, str]:
    """The TP plan pp > 1 applies, every chunk's (`tp_plan(chunk)`) in one dict: what a
    generated program prints and passes back as ``tp``. With sequence parallelism each chunk's
    first block splits the sequence and its last gathers it. ``model`` may be on the meta
    device; it is not changed (the chunks share its modules). ``roles``: as `tp_plan`'s
    (`Plan.tensor_parallel_roles`)."""
    if config.tp == 1:  # nothing to split (and a traced cut has no StageModules to ask)
        return {}
    layout = layout_for(config, model, stage_layers, schedule)
    vocab = _vocab_layers(model, config)
    plan: dict[str, str] = {}
    for rank in range(config.pp):
        for chunk in build_stage_modules(model, layout, rank):
            plan.update(_chunk_plan(chunk, config, placements, vocab, roles))
    return plan


def _vocab_layers(model: nn.Module, config: ParallelConfig) -> tuple[str, str, str | None] | None:
    """The whole model's token embedding and head (`find_vocab_layers`), which the chunks
    holding them split over the vocabulary as with pp = 1 (the trainer runs the schedule under
    loss_parallel()); None with cp, whose loss reads whole-vocabulary logits."""
    return find_vocab_layers(model, find_blocks(model)) if config.cp == 1 else None


def _chunk_plan(
    chunk: nn.Module,
    config: ParallelConfig,
    placements: dict | None,
    vocab: tuple[str, str, str | None] | None,
    roles: dict[str, str] | None = None,
) -> dict[str, str]:
    """One pipeline chunk's TP plan: its blocks' (`tp_plan(chunk)`: with SP the chunk's
    first block splits the sequence, its last gathers it), and the vocabulary split of the
    embedding or head it holds."""
    plan = tp_plan(chunk, config, placements, roles=roles)
    if not plan or vocab is None:
        return plan
    held = {name for name, _ in chunk.named_modules()}
    embedding, head, _ = vocab
    return {
        **({embedding: "vocab_embedding"} if embedding in held else {}),
        **plan,
        **({head: "vocab_head"} if head in held else {}),
    }


def _merge_modules(modules: list[nn.Module]) -> nn.Module:
    """One module holding the children of ``modules`` under their own paths (a rank's pipeline
    chunks; the blocks of several chunks in one ModuleDict), so parameter names stay the
    original ones; the module itself when there is one."""
    if len(modules) == 1:
        return modules[0]
    if any(next(m.parameters(recurse=False), None) is not None for m in modules):
        raise ValueError("cannot merge modules that hold parameters of their own")
    root = nn.ModuleDict() if all(isinstance(m, nn.ModuleDict) for m in modules) else nn.Module()
    for name in dict.fromkeys(n for m in modules for n in m._modules):
        held = [m._modules[name] for m in modules if m._modules.get(name) is not None]
        distinct = list({id(h): h for h in held}.values())  # shared modules (rotary) once
        root.add_module(name, _merge_modules(distinct))
    return root
