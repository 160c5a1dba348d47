"""Step time and memory of one ParallelConfig: the fast path the search calls thousands of times.

In: the model's `ModelTables`, a `Cluster`, the precision, optimizer and `CostOptions`. Out,
per config and global batch: an `Estimate` (step time and its breakdown, per-stage times and
memory, MFU). `Estimator.evaluate` sequences the parts, each in its own module:

    layer times     per layer class, compute + exposed TP/CP/EP      `layer_cost.layer_time`
    chunks, stages  blocks over pp x v chunks, chunks on stages      `stages`
    stage times     per micro-batch sums, exposed FSDP, split bwd     `stage_time.StageTimer`
    pipeline        the schedule's simulation                        `StageTimer.pipeline`
    tail            gradient sync, optimizer, clipping per stage      `StageTimer.step_tail`
    memory          model state, activations, buffers per stage       `memory.StageMemory`
    stragglers      the step at its slowest device's pace             `Cluster.straggler_share`

    step = (pipeline(stage forward/backward per micro-batch, m micro-batches)
            + max over stages (exposed data-parallel sync + optimizer step + clipping))
           x (1 + the slowest device's excess over the typical one)

A config is priced as its stack runs it (`Estimator.as_run`: under a pipeline kept gathered
over the step, FSDP's ZeRO-1 and ZeRO-2 as its ZeRO-3); the estimate names the config asked.
Layer times and the chunk split depend on fewer fields than a config has (`_times_key`), so
configs that differ only in ZeRO stage, schedule or per-layer recompute share them (cached).
Expert layers: with ep > 1 their experts run the top-k routed rows (`as_run.routed_layer`: a
dense-dispatch MoE's traced expert work times top_k / num_experts), on the busiest rank times
`CostOptions.moe_imbalance` (its matmuls, saved rows and all-to-all bytes); without ep as
traced.

Per-layer recompute (cfg.recompute_layers = k): the policy applies to the first k blocks of
each model chunk (`_recomputed`); the other layers keep their activations ("none") and cost no
recompute time nor, under ZeRO-3 with full recompute, a third gather. None applies the policy
to every block (the runtime never wraps the embedding, the head or other layers). The chunk
split is the all-layer policy's, so k changes no stage boundary. Per stage s, with d_l = a_l^none
- a_l^policy >= 0 the bytes a recomputed layer l drops and n_s >= 1 in-flight micro-batches,
    act_s(k) = sum_l a_l^none n_s - sum_{l recomputed} d_l n_s + max_{l recomputed} d_l
falls as k grows (a layer added lowers the sum by d_l n_s and raises the max by at most d_l;
the max is the blocks' backward moment, the loss's the other: `memory.StagePhases`), so the
smallest k whose busiest stage fits is found by one scan over k with running sums
(`fewest_recomputed_layers`); step time rises with k, so that k is the fastest of the
policy's per-layer variants.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace
from itertools import accumulate

from autopar.config import ParallelConfig
from autopar.config.precision import Recipe, base_precision, check_recipe, recipe_of
from autopar.errors import ConfigError
from autopar.estimate.as_run import whole_vocabulary
from autopar.estimate.layer_cost import LayerTime, in_recipe, layer_time
from autopar.estimate.memory import (
    OPTIMIZER_BYTES,
    PRECISION_BYTES,
    StageMemory,
    dispatched,
    stage_kept_gathered,
    vocab_whole,
)
from autopar.estimate.mesh import MeshGroups
from autopar.estimate.options import CostOptions, stack_problems
from autopar.estimate.stacks import load_stack
from autopar.estimate.stage_time import StageTimer, StageTimes
from autopar.estimate.staged import StageMesh, evaluate_stages
from autopar.estimate.stages import (
    Chunks,
    chunk_weights,
    linear_partition,
    offloaded_layers,
    recomputed_layers,
    split_chunks,
    stage_layers,
    stage_of_chunk,
)
from autopar.estimate.tables import LayerTable, ModelTables
from autopar.hardware import Cluster
from cost_models.compute import DeviceSpec
from cost_models.memory import PeakMemory
from cost_models.pipeline import peak_inflight_microbatches


@dataclass(frozen=True)
class StageEstimate:
    index: int
    layers: tuple[str, ...]
    forward_s: float  # one micro-batch
    backward_s: float
    memory: PeakMemory
    inflight_microbatches: float = 1.0  # peak activations held, in micro-batches


@dataclass(frozen=True)
class Estimate:
    config: ParallelConfig
    global_batch_size: int
    num_microbatches: int
    step_time_s: float
    breakdown: dict[str, float]
    stages: tuple[StageEstimate, ...]
    peak_memory_bytes: float
    model_flops: float
    mfu: float
    notes: tuple[str, ...] = field(default=())


class Estimator:
    """Prices configs of one model on one cluster (tables built once, comm cached).

    Attributes:
        memory: the `StageMemory` (parameters on a rank, peak memory per stage).
        timer: the `StageTimer` (stage times, pipeline, the step's tail).
    """

    def __init__(
        self,
        tables: ModelTables,
        cluster: Cluster,
        *,
        precision: str = "bf16",
        optimizer: str = "adamw",
        options: CostOptions | None = None,
    ) -> None:
        self.recipe = recipe_of(precision)  # ConfigError for an unknown precision
        if self.recipe is not None:
            profile = cluster.profile
            check_recipe(self.recipe, profile.name, profile.device.name, profile.kind,
                         profile.device.peak_flops_per_s)  # fmt: skip
        precision = base_precision(precision)
        peaks = cluster.profile.device.peak_flops_per_s
        if cluster.profile.kind == "gpu" and precision not in peaks:
            raise ConfigError(
                f"precision {precision} cannot run on {cluster.profile.name} "
                f"({cluster.profile.device.name}): it has no {precision} tensor cores (peak "
                f"FLOP/s given for {', '.join(sorted(peaks))}); use one of those"
            )
        if (optimizer, True) not in OPTIMIZER_BYTES:
            known = sorted({k for k, _ in OPTIMIZER_BYTES})
            raise ConfigError(f"optimizer must be one of {', '.join(known)}, got {optimizer!r}")
        self.tables = tables
        self.cluster = cluster
        self.device = cluster.profile.device  # the stack's kernels scale it below
        self.precision = precision
        self.optimizer = optimizer
        self.options = options or CostOptions()
        if cluster.profile.kind == "cpu":
            # gloo copies, reduces and moves bytes through loopback on the very cores the ranks
            # compute on, so no collective hides behind compute (local validation, 2026-11-21:
            # FSDP ZeRO-3 on 2 CPU ranks measured 67 ms per extra micro-batch, priced ~0 with
            # prefetch; the Spearman rank correlation over 17 configs rose from -0.1 to 0.79)
            self.options = replace(
                self.options,
                tp_comm_overlap=0.0,
                async_tp_overlap=0.0,
                overlap_grad_reduce=False,
                overlap_param_gather=False,
                fsdp_prefetch=False,
            )
        # the stack's kernels against those of the stack the profile's curves describe
        if not self.options.stack:  # one's own values: factors of the profile's curves
            reference = CostOptions()
        elif self.options.stack == cluster.profile.efficiency_stack:
            reference = self.options
        else:
            reference = load_stack(cluster.profile.efficiency_stack).options
        self.device = stack_device(self.device, self.options, reference)
        self.memory_traffic = self.options.memory_traffic / reference.memory_traffic
        self.act_scale = PRECISION_BYTES[precision] / tables.traced_float_bytes
        common = dict(
            precision=precision, optimizer=optimizer, options=self.options, act_scale=self.act_scale
        )
        self.memory = StageMemory(tables, **common)
        self.converted = converted_layers(tables, self.recipe, self.options.torchao_linears)
        self.timer = StageTimer(tables, cluster, self.memory, **common)
        if self.recipe and self.recipe.fp8_all_gather and self.options.fp8_all_gather:
            self.timer.gather_scale = {
                name: 1 - fraction / 2 for name, fraction in self.converted.items()
            }
        # the runtime overheads tell FSDP2 ZeRO-3 from ZeRO-1/2 (`_times_key`)
        self._zero3_apart = bool(cluster.profile.runtime_overhead_s)
        self.peak_flops = self.device.peak(precision)
        self._partition_cache: dict[tuple, list[int]] = {}
        self._mesh_cache: dict[tuple, MeshGroups] = {}
        self._times_cache: dict[ParallelConfig, dict[str, LayerTime]] = {}
        self._chunks_cache: dict[tuple, Chunks] = {}
        self._whole_vocab: tuple[LayerTable, ...] | None = None

    # ------------------------------------------------------------------ public

    def evaluate(
        self, cfg: ParallelConfig, global_batch_size: int, *, time_bound_s: float | None = None
    ) -> Estimate | None:
        """Price ``cfg``; with ``time_bound_s``, return None as soon as a lower bound on the
        step (`StageTimer.step_lower_bound`) exceeds it, before simulating the pipeline."""
        cfg.validate(self.cluster)
        if problems := stack_problems(cfg, self.options):
            raise ConfigError(f"config {cfg.as_text()}: " + "; ".join(problems))
        config, cfg = cfg, self.as_run(cfg)
        m = self.num_microbatches(cfg, global_batch_size)
        mesh = self.mesh(cfg)
        times = self.layer_times(cfg, mesh)
        chunks = self.chunks(cfg, times)
        layers = stage_layers(cfg, chunks)
        rec = recomputed_layers(cfg, chunks)
        off = offloaded_layers(cfg, chunks)
        per_stage = self._stage_times(cfg, mesh, layers, times, rec, chunks[0], m, off)
        bounded = time_bound_s is not None
        if bounded and self.timer.step_lower_bound(cfg, m, per_stage) > time_bound_s:
            return None
        pipe_s, inflight, busiest = self.timer.pipeline(cfg, m, per_stage, mesh)
        tail = [
            self.timer.step_tail(cfg, mesh, ls, st)
            for ls, st in zip(layers, per_stage, strict=True)
        ]
        step = pipe_s + max(sum(t.values()) for t in tail)
        stages = tuple(
            StageEstimate(
                index=i,
                layers=tuple(t.name for t in ls),
                forward_s=st["forward"],
                backward_s=st["backward"],
                memory=self.memory.stage_phases(cfg, ls, inflight[i], rec, m, off).peak(),
                inflight_microbatches=inflight[i],
            )
            for i, (ls, st) in enumerate(zip(layers, per_stage, strict=True))
        )
        breakdown = self.timer.breakdown(m, per_stage[busiest], pipe_s, tail[busiest])
        return self.estimate(config, global_batch_size, m, step, breakdown, stages)

    def estimate(
        self,
        config: ParallelConfig,
        global_batch_size: int,
        microbatches: int,
        step_s: float,
        breakdown: dict[str, float],
        stages: tuple[StageEstimate, ...],
        notes: tuple[str, ...] = (),
    ) -> Estimate:
        """The `Estimate` of a priced step: ``step_s`` at its slowest device's pace (the
        breakdown's stragglers term), the model's FLOPs and the MFU."""
        slowest = step_s * self.cluster.straggler_share  # the pace of the slowest device
        if slowest:
            breakdown["stragglers"] = slowest
            step_s += slowest
        model_flops = self.tables.model_flops_per_sample * global_batch_size
        return Estimate(
            config=config,
            global_batch_size=global_batch_size,
            num_microbatches=microbatches,
            step_time_s=step_s,
            breakdown=breakdown,
            stages=stages,
            peak_memory_bytes=max(s.memory.total_bytes for s in stages),
            model_flops=model_flops,
            mfu=model_flops / (step_s * self.cluster.world_size * self.peak_flops),
            notes=notes,
        )

    def evaluate_stages(
        self,
        stages: list[StageMesh],
        global_batch_size: int,
        micro_batch_size: int,
        shared: ParallelConfig | None = None,
    ) -> Estimate:
        """Price a pipeline whose stages have meshes and cuts of their own, ``shared`` giving
        what they have in common (`autopar.estimate.staged`)."""
        return evaluate_stages(self, stages, global_batch_size, micro_batch_size, shared)

    def _stage_times(
        self,
        cfg: ParallelConfig,
        mesh: MeshGroups,
        layers: list[list[LayerTable]],
        times: dict[str, LayerTime],
        recomputed: frozenset[str] | None,
        first_chunk: list[LayerTable],
        microbatches: int,
        offloaded: frozenset[str] = frozenset(),
    ) -> list[StageTimes]:
        """`StageTimer.stage_times` of every stage, priced once per distinct stage: what a
        stage's times read of a layer is its `LayerTime` (shared by the layers of a class),
        whether it is recomputed and whether it lies in model chunk 0, so stages whose layers
        agree on those in order have the same times (a deep pipeline's middle stages)."""
        first = {t.name for t in first_chunk}
        seen: dict[tuple, StageTimes] = {}
        out = []
        for ls in layers:
            key = tuple(
                (id(times[t.name]), recomputed is None or t.name in recomputed, t.name in first,
                 t.name in offloaded)
                for t in ls
            )  # fmt: skip
            if key not in seen:
                seen[key] = self.timer.stage_times(
                    cfg, mesh, ls, times, recomputed, first_chunk, microbatches, offloaded
                )
            out.append(seen[key])
        return out

    def fewest_recomputed_layers(
        self,
        cfg: ParallelConfig,
        global_batch_size: int,
        capacity_bytes: float,
        max_layers: int | None = None,
    ) -> int | None:
        """The smallest ``recompute_layers`` k (1 .. ``max_layers``, default the blocks of the
        fullest chunk) for which every stage of ``cfg`` fits in ``capacity_bytes``; None when
        no k fits or cfg recomputes nothing. Memory only: per stage, the bytes with no block
        recomputed less what the first k blocks of its chunks drop (module docstring), for
        every k at once; the time of that k is evaluate()'s."""
        if cfg.recompute == "none":
            return None
        cfg = replace(self.as_run(cfg), recompute_layers=None)
        m, chunks, layers, inflight = self._memory_setup(cfg, global_batch_size)
        blocks = [[t for t in c if t.kind == "block"] for c in chunks]
        top = max(len(b) for b in blocks)
        if max_layers is not None:
            top = min(top, max_layers)
        if top < 1:
            return None
        # per stage and block position j in its chunks: bytes dropped (summed), transient (max)
        dropped = [[0.0] * top for _ in layers]
        transient = [[0.0] * top for _ in layers]
        activations = self.memory.activation_bytes
        by_class: dict[str, float] = {}  # the blocks of a class drop the same bytes
        for k, chunk in enumerate(blocks):
            s = stage_of_chunk(cfg, k)
            for j, table in enumerate(chunk[:top]):
                d = by_class.get(table.class_id)
                if d is None:
                    policy = self.memory.policy(cfg, table, None)
                    d = activations(cfg, table, "none") - activations(cfg, table, policy)
                    by_class[table.class_id] = d
                dropped[s][j] += d
                transient[s][j] = max(transient[s][j], d)
        phases = [
            self.memory.stage_phases(cfg, ls, inflight[i], frozenset(), m)
            for i, ls in enumerate(layers)
        ]
        # per stage, for k = 1 .. top: the bytes the first k positions drop, and the largest
        # block recomputed among them
        drops = [
            list(accumulate(d * max(1.0, f) for d in ds))
            for ds, f in zip(dropped, inflight, strict=True)
        ]
        peaks = [list(accumulate(ts, max)) for ts in transient]

        def fits(k: int) -> bool:
            return all(
                p.peak(dropped=drops[s][k - 1], transient=peaks[s][k - 1]).total_bytes
                <= capacity_bytes
                for s, p in enumerate(phases)
            )

        if min(by_class.values(), default=0.0) < 0:  # a block that keeps more recomputed
            return next((k for k in range(1, top + 1) if fits(k)), None)
        # each block recomputed drops at least the bytes it adds as the transient, so a
        # stage's peak never grows with k: the smallest k that fits is found by bisection
        k = bisect_left(range(1, top + 1), True, key=fits) + 1
        return k if k <= top else None

    def fewest_offloaded_layers(
        self, cfg: ParallelConfig, global_batch_size: int, capacity_bytes: float
    ) -> int | None:
        """The smallest ``offload_layers`` k (1 .. the blocks of the fullest chunk) for which
        every stage of ``cfg`` fits in ``capacity_bytes``; None when none does. Memory only
        (each stage's peak with its chunks' first k blocks offloaded, `stage_phases`); the
        time of that k is evaluate()'s."""
        cfg = self.as_run(cfg)
        m, chunks, layers, inflight = self._memory_setup(cfg, global_batch_size)
        top = max(sum(t.kind == "block" for t in c) for c in chunks)
        rec = recomputed_layers(cfg, chunks)
        for k in range(1, top + 1):  # the copy buffers follow the largest block: scan, not bisect
            off = offloaded_layers(replace(cfg, offload_layers=k), chunks)
            if all(
                self.memory.stage_phases(cfg, ls, inflight[i], rec, m, off).peak().total_bytes
                <= capacity_bytes
                for i, ls in enumerate(layers)
            ):
                return k
        return None

    def _memory_setup(
        self, cfg: ParallelConfig, global_batch_size: int
    ) -> tuple[int, Chunks, Chunks, list[float]]:
        """What the memory-only searches read of ``cfg``: its micro-batches, chunks, stages'
        layers and each stage's micro-batches in flight (the schedule's op order alone sets
        them: no simulation)."""
        m = self.num_microbatches(cfg, global_batch_size)
        chunks = self.chunks(cfg, self.layer_times(cfg, self.mesh(cfg)))
        inflight = [1.0]
        if cfg.pp > 1:
            inflight = list(peak_inflight_microbatches(cfg.schedule, cfg.pp, m, cfg.virtual_stages))
        return m, chunks, stage_layers(cfg, chunks), inflight

    def as_run(self, cfg: ParallelConfig) -> ParallelConfig:
        """``cfg`` as the stack runs it: under a pipeline that keeps its stages gathered with
        unsharded gradients over the step (`CostOptions.pp_keeps_unsharded`), FSDP's ZeRO-1
        and ZeRO-2 run as its ZeRO-3 does (torch's pipelining turns their per-micro-batch
        reduce-scatters and reshards off alike: on 4 CPU ranks PP2 x FSDP2 held the same
        82.5 MiB under all three), so they are priced as it is."""
        kept = stage_kept_gathered(cfg, self.options)
        return replace(cfg, zero_stage=3) if kept and cfg.zero_stage < 3 else cfg

    # ------------------------------------------------------------------ structure, cached

    def num_microbatches(self, cfg: ParallelConfig, global_batch_size: int) -> int:
        """Micro-batches per step: the global batch over micro-batch size x dp x fsdp.

        Raises:
            ConfigError: the global batch is not a multiple of that.
        """
        per_step = cfg.micro_batch_size * cfg.data_parallel_size
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
                f"{cfg.micro_batch_size} x dp={cfg.dp} x fsdp={cfg.fsdp} = {per_step}"
            )
        return global_batch_size // per_step

    def mesh(self, cfg: ParallelConfig) -> MeshGroups:
        """The config's groups on the cluster, pricing collectives per axis (cached)."""
        key = (cfg.dp, cfg.fsdp, cfg.cp, cfg.tp, cfg.pp, cfg.ep, cfg.axis_order)
        if key not in self._mesh_cache:
            self._mesh_cache[key] = MeshGroups(self.cluster, cfg)
        return self._mesh_cache[key]

    @staticmethod
    def times_key(cfg: ParallelConfig, zero3_apart: bool = True) -> ParallelConfig:
        """``cfg`` less what layer times do not depend on (ZeRO stage, schedule, per-layer
        recompute): configs with one key share their layer times and stage split."""
        # ZeRO-3 keeps its own key where the profile's runtime overheads tell FSDP2 ZeRO-3
        # from ZeRO-1/2 (else it would only split the caches: a 70B search re-derived its
        # stage splits, +15% search time); the split backward's overhead depends on the
        # schedule: `StageTimer.stage_times` adds it
        zero = 3 if cfg.zero_stage == 3 and zero3_apart else 0
        return replace(
            cfg,
            zero_stage=zero,
            schedule="1f1b",
            virtual_stages=1,
            recompute_layers=None,
            pipeline_slots=(),
            offload_layers=0,
        )

    def layer_times(self, cfg: ParallelConfig, mesh: MeshGroups) -> dict[str, LayerTime]:
        """Per layer name, its time under ``cfg`` (cached per `times_key`; do not mutate).
        `autopar.solve.refine.RepricedEstimator` overrides it with the ILP's layer costs."""
        key = self.times_key(cfg, self._zero3_apart)
        cached = self._times_cache.get(key)
        if cached is None:
            cached = self._times_cache[key] = self._price_layers(cfg, mesh)
        return cached

    def _price_layers(self, cfg: ParallelConfig, mesh: MeshGroups) -> dict[str, LayerTime]:
        by_class: dict[tuple[str, bool], LayerTime] = {}
        out = {}
        last = self.tables.layers[-1].name
        for table in self._layers(cfg):
            # the model's last layer also carries the runtime's host work outside the
            # repeated layers, once per micro-batch
            model = table.name == last and bool(self.cluster.profile.model_overhead_s)
            key = (table.class_id, model, table.name in self.converted)
            if key not in by_class:
                by_class[key] = self.price_layer(table, cfg, mesh, model_overheads=model)
            out[table.name] = by_class[key]
        return out

    def tp_overlap(self, cfg: ParallelConfig) -> float:
        """The share of tp communication hidden under the GEMMs (the stack's, or its async
        TP's where ``cfg.async_tp``): the hidden part still slows the GEMMs it overlaps
        (`CostOptions.comm_interference`)."""
        hidden = self.options.tp_comm_overlap
        if cfg.async_tp:
            hidden = max(hidden, self.options.async_tp_overlap)
        return hidden * (1 - self.options.comm_interference)

    def price_layer(
        self, table: LayerTable, cfg: ParallelConfig, mesh: MeshGroups, *, model_overheads: bool
    ) -> LayerTime:
        """``table``'s layer under ``cfg``, one micro-batch, with this estimator's device,
        precision, recipe and stack options; ``model_overheads``: it carries the profile's
        `model_overhead_s` (the model's last layer). The one place a layer is priced: the
        refine pass (`autopar.solve.refine`) re-prices through it too."""
        profile = self.cluster.profile
        return layer_time(
            dispatched(cfg, table, self.options.moe_imbalance),
            cfg,
            self.device,
            self.precision,
            self.act_scale,
            mesh.time,
            self.tp_overlap(cfg),
            profile.runtime_overhead_s,
            profile.model_overhead_s if model_overheads else None,
            memory_traffic=self.memory_traffic,
            recipe=self.recipe if table.name in self.converted else None,
            cast_traffic=self.options.cast_traffic,
            torchao_linears=self.options.torchao_linears,
            recipe_host_s=self.options.recipe_host_s,
            recompute_up_projections=self.options.recompute_up_projections,
        )

    def chunks(self, cfg: ParallelConfig, times: dict[str, LayerTime]) -> Chunks:
        """The model's pp x v chunks under ``cfg`` (`stages.split_chunks`), balanced by
        ``times`` when `CostOptions.balance_stages`; cached when ``times`` are this
        estimator's own."""
        key = self.times_key(cfg, self._zero3_apart)
        if self._times_cache.get(key) is not times:
            return self._split(cfg, times)
        key = (key, cfg.pp, cfg.virtual_stages, cfg.pipeline_slots)
        if key not in self._chunks_cache:
            self._chunks_cache[key] = self._split(cfg, times)
        return self._chunks_cache[key]

    def _layers(self, cfg: ParallelConfig) -> tuple[LayerTable, ...]:
        """The model's layers as the stack runs them under ``cfg``: the embedding and head
        whole on every tp rank where it does not split the vocabulary (`memory.vocab_whole`)."""
        if not vocab_whole(cfg, self.options):
            return self.tables.layers
        if self._whole_vocab is None:
            self._whole_vocab = tuple(whole_vocabulary(t) for t in self.tables.layers)
        return self._whole_vocab

    def _split(self, cfg: ParallelConfig, times: dict[str, LayerTime]) -> Chunks:
        if not self.options.balance_stages:
            return split_chunks(self._layers(cfg), cfg)
        work = [times[t.name].forward_s + times[t.name].backward_s for t in self.tables.layers]

        def balanced(blocks: list[int], n_chunks: int) -> list[int]:
            weights = chunk_weights(work, blocks)
            key = (n_chunks, tuple(float(f"{w:.6g}") for w in weights))
            if key not in self._partition_cache:
                self._partition_cache[key] = linear_partition(weights, n_chunks)
            return self._partition_cache[key]

        return split_chunks(self._layers(cfg), cfg, balanced)


def converted_layers(
    tables: ModelTables, recipe: Recipe | None, torchao_linears: bool = False
) -> dict[str, float]:
    """The blocks ``recipe`` runs in low precision (all but its BF16 edge blocks), each with
    the fraction of its parameter bytes in the linears that run in it (their weights;
    `layer_cost.in_recipe`)."""
    if recipe is None:
        return {}
    out = {}
    for t in recipe.covered([t for t in tables.layers if t.kind == "block"]):
        params = (t.params_tp + t.params_rep + t.params_expert) * tables.traced_float_bytes
        linear = sum(op.weight_bytes for op in t.matmuls if in_recipe(op, recipe, torchao_linears))
        out[t.name] = min(1.0, linear / params) if params else 0.0
    return out


def stack_device(device: DeviceSpec, options: CostOptions, reference: CostOptions) -> DeviceSpec:
    """``device`` as ``options``' stack runs it, when its curves describe ``reference``'s: the
    matmul (fp32's too) and attention curves' achievable fraction of peak scaled by the ratio
    of the two stacks' `matmul_efficiency` / `attention_efficiency` (capped at 1: no kernel
    beats the peak)."""
    matmul = options.matmul_efficiency / reference.matmul_efficiency
    attention = options.attention_efficiency / reference.attention_efficiency
    if matmul == 1.0 and attention == 1.0:
        return device
    fp32 = device.matmul_fp32
    return replace(
        device,
        matmul=replace(device.matmul, max=min(1.0, device.matmul.max * matmul)),
        matmul_fp32=fp32 and replace(fp32, max=min(1.0, fp32.max * matmul)),
        attention=replace(device.attention, max=min(1.0, device.attention.max * attention)),
    )
