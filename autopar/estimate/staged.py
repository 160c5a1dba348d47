"""Pipelines whose stages differ in mesh and cut: each stage its own tp and dp, cuts inside layers.

In: the `Estimator` of one model on one cluster, one `StageMesh` per pipeline stage (the parts
of the model's layers it runs, its tensor- and data-parallel degrees, what it recomputes), the
global and micro-batch sizes, and a `ParallelConfig` for what the stages share (precision-free
settings: sequence parallelism, ZeRO stage). Out: an `Estimate`, as `Estimator.evaluate`'s.

Such layouts are what operator-level planners search (Aceso, Alpa's stage construction): a
stage of 1 GPU beside a stage of tp 2, the cut between two layers' GEMMs. `ParallelConfig`
holds one mesh for every stage, so these are priced here, from the same parts:
    stage i      its layers' times under a config of its own degrees (tp_i, dp_i, micro-batch
                 mbs / dp_i: its dp ranks split each micro-batch), the `StageTimer`'s per-layer
                 terms scaled by the part's share of the layer; a part recomputing r of its
                 layer's forward pays r of the layer's recompute time
    pipeline     the schedule's simulation over those stage times, gbs / mbs micro-batches,
                 each send a rank's share of one (mbs over the fewest dp ranks of any stage),
                 the stages laid out in order on the devices and each hop priced on the
                 link between its two stages' first ranks (one crossing nodes: the network)
    tail         each stage's gradient sync over its dp ranks (the last stage's tied weights
                 summed with the first stage's), optimizer step and clipping, for its share of
                 the parameters it touches
    memory       per stage, its shares of its layers' model state and, per part, the
                 activations it keeps (`StagePart.keeps`) for the micro-batches in flight; a
                 recomputing part rebuilds the rest of its activations in the backward, the
                 largest of them the stage's transient
The terms are linear in a layer's work, so a layer cut in two costs what its parts do. The
runtime runs one mesh for all stages: these layouts are priced, not run (Aceso's own runtime
runs them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate.mesh import MeshGroups
from cost_models.memory import ModelStateBytes

if TYPE_CHECKING:
    from autopar.estimate.memory import StageMemory
    from autopar.estimate.step import Estimate, Estimator
    from autopar.estimate.tables import LayerTable


@dataclass(frozen=True)
class StagePart:
    """What a stage runs of one layer: ``share`` of its work, re-running ``recompute`` of its
    forward in the backward (both fractions of the whole layer; recompute <= share), keeping
    ``keeps`` of the activations the whole layer saves without recompute (None: ``share`` of
    them less the recomputed part's, and a wholly recomputed layer its policy's)."""

    layer: str
    share: float = 1.0
    recompute: float = 0.0
    keeps: float | None = None


@dataclass(frozen=True)
class StageMesh:
    """One pipeline stage: its parts of the model, in order, on tp x dp devices of its own."""

    parts: tuple[StagePart, ...]
    tp: int = 1
    dp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.dp


def evaluate_stages(
    estimator: Estimator,
    stages: Sequence[StageMesh],
    global_batch_size: int,
    micro_batch_size: int,
    shared: ParallelConfig | None = None,
) -> Estimate:
    """Price the pipeline of ``stages`` (module docstring) under the 1F1B schedule.

    Raises:
        ConfigError: the stages do not use the cluster's devices, a layer is not covered
            exactly once, a share is out of range, or a batch does not divide.
    """
    from autopar.estimate.step import StageEstimate

    base = shared or ParallelConfig()
    tables = {t.name: t for t in estimator.tables.layers}
    _check(stages, tables, estimator.cluster.world_size, global_batch_size, micro_batch_size)
    m = global_batch_size // micro_batch_size
    timer, memory = estimator.timer, estimator.memory
    per_stage, tails, touched, cfgs = [], [], [], []
    # the stages lie in order on the devices: the pipeline's hops and the tied weights' sum
    # (the first and last stages) run between their first ranks
    starts = tuple(sum(s.devices for s in stages[:i]) for i in range(len(stages)))
    for stage in stages:
        cfg = replace(
            base, pp=1, tp=stage.tp, dp=stage.dp, fsdp=1, cp=1, ep=1, virtual_stages=1,
            schedule="1f1b", micro_batch_size=micro_batch_size // stage.dp, recompute="full",
            recompute_layers=None, pipeline_slots=(),
            sequence_parallel=base.sequence_parallel and stage.tp > 1,
        )  # fmt: skip
        mesh = MeshGroups(estimator.cluster, cfg, starts)  # its tied-weight sum: pp_ends
        times = estimator.layer_times(cfg, mesh)
        total: dict[str, float] = defaultdict(float)
        for part in stage.parts:
            layer = [tables[part.layer]]
            kept = timer.stage_times(cfg, mesh, layer, times, frozenset(), (), m)
            for key, value in kept.items():
                total[key] += part.share * value
            if part.recompute:
                rerun = timer.stage_times(cfg, mesh, layer, times, frozenset([part.layer]), (), m)
                for key, value in rerun.items():
                    total[key] += part.recompute * (value - kept[key])
        layers = [tables[p.layer] for p in stage.parts]
        params = [memory.stage_params(cfg, [t]) for t in layers]
        held = sum(p.share * n for p, n in zip(stage.parts, params, strict=True))
        weight = held / sum(params) if sum(params) else 0.0
        tail = timer.step_tail(cfg, mesh, layers, total)
        per_stage.append(dict(total))
        tails.append({k: v * weight for k, v in tail.items()})
        touched.append(layers)
        cfgs.append(cfg)
    # the pipeline's sends: each stage's ranks send their share of a micro-batch, a stage of
    # the fewest dp ranks the largest (one size for every hop)
    sent = micro_batch_size // min(s.dp for s in stages)
    pipe = replace(
        base, pp=len(stages), tp=1, dp=1, fsdp=1, cp=1, ep=1, virtual_stages=1, schedule="1f1b",
        micro_batch_size=sent, sequence_parallel=False, pipeline_slots=(),
    )  # fmt: skip
    hops = MeshGroups(estimator.cluster, pipe, stage_ranks=starts)
    pipe_s, inflight, busiest = timer.pipeline(pipe, m, per_stage, hops)
    step = pipe_s + max(sum(t.values()) for t in tails)
    out_stages = []
    for i, (stage, cfg, layers) in enumerate(zip(stages, cfgs, touched, strict=True)):
        dropped, transient = _dropped(memory, cfg, stage, layers)
        phases = memory.stage_phases(cfg, layers, inflight[i], frozenset(), m)
        phases = replace(phases, state=_held_state(memory, cfg, stage, layers))
        out_stages.append(
            StageEstimate(
                index=i,
                layers=tuple(t.name for t in layers),
                forward_s=per_stage[i]["forward"],
                backward_s=per_stage[i]["backward"],
                memory=phases.peak(dropped * max(1.0, inflight[i]), transient),
                inflight_microbatches=inflight[i],
            )
        )
    breakdown = timer.breakdown(m, per_stage[busiest], pipe_s, tails[busiest])
    meshes = " ".join(f"{s.tp}x{s.dp}" for s in stages)
    notes = (f"stages of their own meshes (tp x dp per stage): {meshes}",)
    return estimator.estimate(pipe, global_batch_size, m, step, breakdown, tuple(out_stages), notes)


def _held_state(
    memory: StageMemory, cfg: ParallelConfig, stage: StageMesh, layers: list[LayerTable]
) -> ModelStateBytes:
    """The model state of the stage's shares of its layers (a layer cut in two: each stage
    holds its share of the parameters, their gradients and optimizer state)."""
    terms = ("parameters_bytes", "gradients_bytes", "optimizer_bytes")
    held = dict.fromkeys(terms, 0.0)
    for part, table in zip(stage.parts, layers, strict=True):
        state = memory.model_state(cfg, [table])
        for term in terms:
            held[term] += part.share * getattr(state, term)
    return ModelStateBytes(**held)


def _dropped(
    memory: StageMemory, cfg: ParallelConfig, stage: StageMesh, layers: list[LayerTable]
) -> tuple[float, float]:
    """One micro-batch's activations the stage's parts do not keep of their whole layers, and
    the largest a recomputing part rebuilds in its backward (`StagePart.keeps`)."""
    dropped, transient = 0.0, 0.0
    for part, table in zip(stage.parts, layers, strict=True):
        whole = memory.activation_bytes(cfg, table, "none")
        if part.keeps is not None:
            kept = part.keeps * whole
        elif part.recompute and part.recompute >= part.share - 1e-9:
            kept = part.share * memory.activation_bytes(cfg, table, memory.policy(cfg, table, None))
        else:
            kept = (part.share - part.recompute) * whole
        dropped += whole - kept
        if part.recompute:
            transient = max(transient, part.share * whole - kept)
    return dropped, transient


def _check(
    stages: Sequence[StageMesh],
    tables: dict[str, LayerTable],
    world: int,
    global_batch_size: int,
    micro_batch_size: int,
) -> None:
    """ConfigError naming what is wrong with ``stages`` (`evaluate_stages`)."""
    if not stages:
        raise ConfigError("a staged pipeline needs at least one stage")
    used = sum(s.devices for s in stages)
    if used != world:
        raise ConfigError(
            f"the {len(stages)} stages use {used} devices (tp x dp summed) but the cluster "
            f"has {world}"
        )
    if micro_batch_size < 1 or global_batch_size % micro_batch_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of "
            f"micro_batch_size={micro_batch_size}"
        )
    covered: dict[str, float] = defaultdict(float)
    for i, stage in enumerate(stages):
        if stage.tp < 1 or stage.dp < 1 or micro_batch_size % stage.dp:
            raise ConfigError(
                f"stage {i}: tp={stage.tp} x dp={stage.dp} must be >= 1 and dp must divide "
                f"micro_batch_size={micro_batch_size} (its dp ranks split each micro-batch)"
            )
        for part in stage.parts:
            if part.layer not in tables:
                raise ConfigError(f"stage {i}: the model has no layer {part.layer!r}")
            if not 0 < part.share <= 1 or not 0 <= part.recompute <= part.share + 1e-9:
                raise ConfigError(
                    f"stage {i}, {part.layer}: share={part.share} must be in (0, 1] and "
                    f"recompute={part.recompute} in [0, share]"
                )
            covered[part.layer] += part.share
    for name in tables:
        if abs(covered[name] - 1.0) > 1e-6:
            raise ConfigError(
                f"layer {name!r}: the stages hold {covered[name]:g} of it, not all of it once"
            )
