"""Step time and memory of one ParallelConfig: the fast path the search calls thousands of times.

    step = pipeline(stage forward/backward per micro-batch, m micro-batches)      (_pipeline)
           + max over stages (exposed data-parallel sync + optimizer step + clipping)

Stages: the blocks split evenly over pp * v model chunks (extra blocks to the middle chunks),
layers before the first block on chunk 0, after the last on the last chunk; chunk k runs on
stage k mod pp (interleaved) or on the V of DualPipe-V. A stage's forward per micro-batch is
the sum of its layers' `layer_time` forward (compute + exposed TP/CP/EP) plus exposed FSDP
gathers; its backward likewise. The pipeline comes from `cost_models.pipeline`'s simulation;
on ranks that time-share CPU cores, from `cost_models.pipeline_shared`'s at the full rate (a
rank in a bubble leaves its core to the busy ones).

Data parallel, per stage, gradients G bytes (params on the rank x grad bytes):
    ZeRO-0   all-reduce G over dp; with ep > 1 the experts' G_e are left out of it and summed
    over the dp / ep ranks holding the same experts after the backward (exposed; none when
    dp = ep), as `autopar.runtime.expert_parallel` does; ZeRO-1/2 reduce-scatter G over fsdp
    (+ all-reduce G/fsdp over dp for HSDP) then all-gather the bf16 params; ZeRO-3
    all-gathers each layer forward and backward and reduce-scatters its gradients, every
    micro-batch (one call per layer, or per parameter tensor with `fsdp_per_tensor`; with
    `fsdp_list_copies` each call also copies to or from its n per-rank views,
    `cost_models.compute.list_collective_time_s`).
    Overlap (none on a CPU profile: gloo runs on the compute cores): gradient reduction
    hides behind the last micro-batch's backward except the last bucket; FSDP gathers are
    prefetched behind the previous layer's compute (exposed: what the stage's compute cannot
    cover, plus the first gather).
Expert layers: with ep > 1 their experts run the top-k routed rows (`tables.routed_layer`: a
dense-dispatch MoE's traced expert work times top_k / num_experts), without it as traced.
Optimizer: memory bound, bytes per parameter by optimizer and precision (`_OPTIMIZER_BYTES`).
Memory per stage: model state (cost_models.memory.model_state_bytes), activations of the
in-flight micro-batches, one layer's recompute transient, logits on the last stage,
communication buffers, and the allocator reserve.

Per-layer recompute (cfg.recompute_layers = k): the policy applies to the first k blocks of
each model chunk (`_recomputed`); the other layers keep their activations ("none") and cost no
recompute time nor, under ZeRO-3 with full recompute, a third gather. None applies the policy
to every block (the runtime never wraps the embedding, the head or other layers). The chunk
split is the all-layer policy's, so k changes no stage boundary. Per stage s, with d_l = a_l^none
- a_l^policy >= 0 the bytes a recomputed layer l drops and n_s >= 1 in-flight micro-batches,
    act_s(k) = sum_l a_l^none n_s - sum_{l recomputed} d_l n_s + max_{l recomputed} d_l
falls as k grows (a layer added lowers the sum by d_l n_s and raises the max by at most d_l),
so the smallest k whose busiest stage fits is found by one scan over k with running sums
(`fewest_recomputed_layers`); step time rises with k, so that k is the fastest of the
policy's per-layer variants.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate.communication import tied_elements
from autopar.estimate.layer_cost import (
    LayerTime,
    layer_time,
    runtime_overhead_s,
    split_backward_overhead_s,
)
from autopar.estimate.mesh import MeshGroups
from autopar.estimate.options import CostOptions
from autopar.estimate.pipeline_timer import PipelineTimer
from autopar.estimate.tables import LayerTable, ModelTables, routed_layer
from cost_models.compute import list_collective_time_s, op_time_s
from cost_models.memory import (
    PeakMemory,
    allocator_reserve_bytes,
    model_state_bytes,
    peak_memory,
)
from cost_models.pipeline import peak_inflight_microbatches

# Bytes read + written per parameter by one optimizer step (fp32 master weights, fp32 grads).
# AdamW mixed precision: read master, m, v, grad (16), write master, m, v (12), bf16 copy (2).
_OPTIMIZER_BYTES = {
    ("adamw", True): 30,
    ("adamw", False): 28,
    ("adam", True): 30,
    ("adam", False): 28,
    ("sgd_momentum", True): 22,
    ("sgd_momentum", False): 20,
    ("sgd", True): 14,
    ("sgd", False): 12,
}
_PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


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
    """Prices configs of one model on one cluster (tables built once, comm cached)."""

    def __init__(
        self,
        tables: ModelTables,
        cluster: Cluster,
        *,
        precision: str = "bf16",
        optimizer: str = "adamw",
        options: CostOptions | None = None,
    ) -> None:
        if precision not in _PRECISION_BYTES:
            raise ConfigError(f"precision must be one of bf16, fp16, fp32, got {precision!r}")
        if (optimizer, True) not in _OPTIMIZER_BYTES:
            known = sorted({k for k, _ in _OPTIMIZER_BYTES})
            raise ConfigError(f"optimizer must be one of {', '.join(known)}, got {optimizer!r}")
        self.tables = tables
        self.cluster = cluster
        self.device = cluster.profile.device
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
                overlap_grad_reduce=False,
                overlap_param_gather=False,
                fsdp_prefetch=False,
            )
        self.act_scale = _PRECISION_BYTES[precision] / tables.traced_float_bytes
        self._tied = tied_elements(tables)  # a tied embedding's elements (0: none)
        self._experts = any(t.params_expert for t in tables.layers)
        # the runtime overheads tell FSDP2 ZeRO-3 from ZeRO-1/2 (`_times_key`)
        self._zero3_apart = bool(cluster.profile.runtime_overhead_s)
        self.peak_flops = self.device.peak(precision)
        self._pipeline_timer = PipelineTimer()
        self._partition_cache: dict[tuple, list[int]] = {}
        self._mesh_cache: dict[tuple, MeshGroups] = {}
        self._times_cache: dict[ParallelConfig, dict[str, LayerTime]] = {}
        self._chunks_cache: dict[tuple, list[list[LayerTable]]] = {}
        self._activation_cache: dict[tuple, float] = {}

    # ------------------------------------------------------------------ public

    def evaluate(
        self, cfg: ParallelConfig, global_batch_size: int, *, time_bound_s: float | None = None
    ) -> Estimate | None:
        """Price ``cfg``; with ``time_bound_s``, return None as soon as the busiest stage's
        work alone (a lower bound on the step) exceeds it, before simulating the pipeline."""
        cfg.validate(self.cluster)
        m = self._num_microbatches(cfg, global_batch_size)
        mesh = self._mesh(cfg)
        times = self._layer_times(cfg, mesh)
        chunks = self._chunks(cfg, times)
        stage_layers = self._stage_layers(cfg, chunks)
        rec = self._recomputed(cfg, chunks)
        per_stage = [
            self._stage_times(cfg, mesh, ls, times, rec, first_chunk=chunks[0])
            for ls in stage_layers
        ]
        if time_bound_s is not None:
            # a time-shared pipeline stage runs at up to the full rate while others idle
            share = self.cluster.compute_share if cfg.pp > 1 else 1.0
            busy = max(m * (s["forward"] + s["backward"]) for s in per_stage) * share
            if busy > time_bound_s:
                return None
        pipe_s, inflight, busiest = self._pipeline(cfg, m, per_stage, mesh)
        tail = [
            self._step_tail(cfg, mesh, ls, st)
            for ls, st in zip(stage_layers, per_stage, strict=True)
        ]
        tail_s = max(sum(t.values()) for t in tail)
        step = pipe_s + tail_s
        breakdown = self._breakdown(cfg, m, per_stage[busiest], pipe_s, tail[busiest])
        stages = tuple(
            StageEstimate(
                index=i,
                layers=tuple(t.name for t in ls),
                forward_s=st["forward"],
                backward_s=st["backward"],
                memory=self._stage_memory(cfg, i, ls, inflight[i], rec),
                inflight_microbatches=inflight[i],
            )
            for i, (ls, st) in enumerate(zip(stage_layers, per_stage, strict=True))
        )
        model_flops = self.tables.model_flops_per_sample * global_batch_size
        world = self.cluster.world_size
        return Estimate(
            config=cfg,
            global_batch_size=global_batch_size,
            num_microbatches=m,
            step_time_s=step,
            breakdown=breakdown,
            stages=stages,
            peak_memory_bytes=max(s.memory.total_bytes for s in stages),
            model_flops=model_flops,
            mfu=model_flops / (step * world * self.peak_flops),
        )

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
        cfg = replace(cfg, recompute_layers=None)
        m = self._num_microbatches(cfg, global_batch_size)
        times = self._layer_times(cfg, self._mesh(cfg))
        chunks = self._chunks(cfg, times)
        blocks = [[t for t in c if t.kind == "block"] for c in chunks]
        top = max(len(b) for b in blocks)
        if max_layers is not None:
            top = min(top, max_layers)
        if top < 1:
            return None
        stage_layers = self._stage_layers(cfg, chunks)
        inflight = [1.0]  # the schedule's op order alone sets it: no simulation
        if cfg.pp > 1:
            inflight = list(peak_inflight_microbatches(cfg.schedule, cfg.pp, m, cfg.virtual_stages))
        # per stage and block position j in its chunks: bytes dropped (summed), transient (max)
        dropped = [[0.0] * top for _ in stage_layers]
        transient = [[0.0] * top for _ in stage_layers]
        for k, chunk in enumerate(blocks):
            s = self._stage_of_chunk(cfg, k)
            for j, table in enumerate(chunk[:top]):
                d = self._activation_bytes(cfg, table, "none") - self._activation_bytes(
                    cfg, table, cfg.recompute
                )
                dropped[s][j] += d
                transient[s][j] = max(transient[s][j], d)
        live, drop, peak = [], [0.0] * len(stage_layers), [0.0] * len(stage_layers)
        for i, ls in enumerate(stage_layers):
            base = self._stage_memory(cfg, i, ls, inflight[i], frozenset())
            live.append(base.total_bytes - base.reserve_bytes)
        for k in range(1, top + 1):
            fits = True
            for s in range(len(stage_layers)):
                drop[s] += dropped[s][k - 1] * max(1.0, inflight[s])
                peak[s] = max(peak[s], transient[s][k - 1])
                now = live[s] - drop[s] + peak[s]
                reserve = allocator_reserve_bytes(now, fraction=self.options.reserve_fraction)
                fits = fits and now + reserve <= capacity_bytes
            if fits:
                return k
        return None

    # ------------------------------------------------------------------ structure

    def _num_microbatches(self, cfg: ParallelConfig, global_batch_size: int) -> int:
        per_step = cfg.micro_batch_size * cfg.data_parallel_size
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
                f"{cfg.micro_batch_size} x dp={cfg.dp} x fsdp={cfg.fsdp} = {per_step}"
            )
        return global_batch_size // per_step

    def _mesh(self, cfg: ParallelConfig) -> MeshGroups:
        key = (cfg.dp, cfg.fsdp, cfg.cp, cfg.tp, cfg.pp, cfg.ep, cfg.axis_order)
        if key not in self._mesh_cache:
            self._mesh_cache[key] = MeshGroups(self.cluster, cfg)
        return self._mesh_cache[key]

    @staticmethod
    def _times_key(cfg: ParallelConfig, zero3_apart: bool = True) -> ParallelConfig:
        """``cfg`` less what layer times do not depend on (ZeRO stage, schedule, per-layer
        recompute): configs with one key share their layer times and stage split."""
        # ZeRO-3 keeps its own key where the profile's runtime overheads tell FSDP2 ZeRO-3
        # from ZeRO-1/2 (else it would only split the caches: a 70B search re-derived its
        # stage splits, +15% search time); the split backward's overhead depends on the
        # schedule: `_stage_times` adds it
        zero = 3 if cfg.zero_stage == 3 and zero3_apart else 0
        return replace(
            cfg, zero_stage=zero, schedule="1f1b", virtual_stages=1, recompute_layers=None
        )

    def _layer_times(self, cfg: ParallelConfig, mesh: MeshGroups) -> dict[str, LayerTime]:
        """Per layer name, its time under ``cfg`` (cached per `_times_key`; do not mutate)."""
        key = self._times_key(cfg, self._zero3_apart)
        cached = self._times_cache.get(key)
        if cached is None:
            cached = self._times_cache[key] = self._price_layers(cfg, mesh)
        return cached

    def _price_layers(self, cfg: ParallelConfig, mesh: MeshGroups) -> dict[str, LayerTime]:
        profile = self.cluster.profile
        by_class: dict[tuple[str, bool], LayerTime] = {}
        out = {}
        last = self.tables.layers[-1].name
        for table in self.tables.layers:
            # the model's last layer also carries the runtime's host work outside the
            # repeated layers, once per micro-batch
            model = table.name == last and bool(profile.model_overhead_s)
            key = (table.class_id, model)
            if key not in by_class:
                by_class[key] = layer_time(
                    _dispatched(cfg, table),
                    cfg,
                    self.device,
                    self.precision,
                    self.act_scale,
                    mesh.time,
                    self.options.tp_comm_overlap,
                    profile.runtime_overhead_s,
                    profile.model_overhead_s if model else None,
                )
            out[table.name] = by_class[key]
        return out

    def _chunks(self, cfg: ParallelConfig, times: dict[str, LayerTime]) -> list[list[LayerTable]]:
        # the split depends on the times only: cached when they are this estimator's own
        key = self._times_key(cfg, self._zero3_apart)
        if self._times_cache.get(key) is not times:
            return self._split(cfg, times)
        key = (key, cfg.pp, cfg.virtual_stages)
        if key not in self._chunks_cache:
            self._chunks_cache[key] = self._split(cfg, times)
        return self._chunks_cache[key]

    def _split(self, cfg: ParallelConfig, times: dict[str, LayerTime]) -> list[list[LayerTable]]:
        layers = self.tables.layers
        blocks = [i for i, t in enumerate(layers) if t.kind == "block"]
        n_chunks = cfg.pp * cfg.virtual_stages
        if n_chunks == 1:
            return [list(layers)]
        if len(blocks) < n_chunks:
            raise ConfigError(
                f"pp={cfg.pp} x virtual_stages={cfg.virtual_stages} = {n_chunks} model chunks "
                f"but the model has {len(blocks)} repeated layers to split"
            )
        if self.options.balance_stages:
            sizes = self._balanced_sizes(layers, blocks, n_chunks, times)
        else:  # Megatron's even split; extra blocks go to the middle chunks
            base, extra = divmod(len(blocks), n_chunks)
            middle = (n_chunks - extra) // 2
            sizes = [base + (1 if middle <= k < middle + extra else 0) for k in range(n_chunks)]
        ends, count = [], 0
        for size in sizes:
            count += size
            ends.append(blocks[count - 1] + 1)
        ends[-1] = len(layers)  # layers after the last block ride on the last chunk
        starts = [0, *ends[:-1]]  # and those before the first block on the first
        return [list(layers[s:e]) for s, e in zip(starts, ends, strict=True)]

    def _balanced_sizes(
        self,
        layers: tuple[LayerTable, ...],
        blocks: list[int],
        n_chunks: int,
        times: dict[str, LayerTime],
    ) -> list[int]:
        """Blocks per chunk minimising the slowest chunk; the layers before the first block
        and after the last count with the first and last block (embedding, head)."""
        work = [times[t.name].forward_s + times[t.name].backward_s for t in layers]
        weights = [work[i] for i in blocks]
        weights[0] += sum(work[: blocks[0]])
        weights[-1] += sum(work[blocks[-1] + 1 :])
        key = (n_chunks, tuple(float(f"{w:.6g}") for w in weights))
        if key not in self._partition_cache:
            self._partition_cache[key] = linear_partition(weights, n_chunks)
        return self._partition_cache[key]

    def _recomputed(
        self, cfg: ParallelConfig, chunks: list[list[LayerTable]]
    ) -> frozenset[str] | None:
        """Names of the layers cfg.recompute applies to: the first recompute_layers blocks of
        each chunk; every block for recompute_layers None (the runtime wraps blocks only,
        never the embedding, head or other layers: autopar.runtime.recompute)."""
        k = cfg.recompute_layers
        if k is None:
            return frozenset(t.name for c in chunks for t in c if t.kind == "block")
        top = max(sum(t.kind == "block" for t in c) for c in chunks)
        if k > top:
            raise ConfigError(
                f"recompute_layers={k} but the fullest of the {len(chunks)} model chunks "
                f"(pp={cfg.pp} x virtual_stages={cfg.virtual_stages}) holds {top} repeated layers"
            )
        return frozenset(
            name for c in chunks for name in [t.name for t in c if t.kind == "block"][:k]
        )

    def _stage_layers(
        self, cfg: ParallelConfig, chunks: list[list[LayerTable]]
    ) -> list[list[LayerTable]]:
        p = cfg.pp
        stages: list[list[LayerTable]] = [[] for _ in range(p)]
        for k, chunk in enumerate(chunks):
            stages[self._stage_of_chunk(cfg, k)].extend(chunk)
        return stages

    @staticmethod
    def _stage_of_chunk(cfg: ParallelConfig, k: int) -> int:
        """The stage of model chunk k: round-robin, or a V for DualPipe-V."""
        p = cfg.pp
        if cfg.schedule == "dualpipe_v":
            return k if k < p else 2 * p - 1 - k
        return k % p

    # ------------------------------------------------------------------ time

    def _stage_times(
        self,
        cfg: ParallelConfig,
        mesh: MeshGroups,
        layers: list[LayerTable],
        times: dict[str, LayerTime],
        recomputed: frozenset[str] | None = None,
        first_chunk: list[LayerTable] | tuple[()] = (),
    ) -> dict[str, float]:
        """Per micro-batch sums of ``layers``' times, and what the stage adds to them: the
        split backward's host time (its blocks outside ``first_chunk``, model chunk 0: kept
        out of the layer times, which configs of every schedule share) and exposed FSDP."""
        lt = [times[t.name] for t in layers]
        out = {
            "compute_forward": sum(x.compute_forward_s for x in lt),
            "compute_backward": sum(x.compute_backward_s for x in lt),
            "weight_grad": sum(x.weight_grad_s for x in lt),
            "recompute": sum(x.recompute_s for x in lt),
            "tp_comm": sum(x.tp_forward_s + x.tp_backward_s for x in lt),
            "cp_comm": sum(x.cp_forward_s + x.cp_backward_s for x in lt),
            "ep_comm": sum(x.ep_forward_s + x.ep_backward_s for x in lt),
            "forward": sum(x.forward_s for x in lt),
            "backward": sum(x.backward_s for x in lt),
        }
        if recomputed is not None:  # the policy on some blocks only: the rest re-run nothing
            kept = sum(x.recompute_s for t, x in zip(layers, lt, strict=True)
                       if t.name not in recomputed)  # fmt: skip
            out["recompute"] -= kept
            out["backward"] -= kept
        split = split_backward_overhead_s(self.cluster.profile.runtime_overhead_s, cfg)
        if split:  # the weight pass pays it (layer_cost module docstring)
            first = {t.name for t in first_chunk}
            split *= sum(t.kind == "block" and t.name not in first for t in layers)
            for key in ("compute_backward", "weight_grad", "backward"):
                out[key] += split
        fsdp_f, fsdp_b = self._fsdp_exposed(cfg, mesh, layers, out, recomputed)
        out["fsdp_comm"] = fsdp_f + fsdp_b
        out["forward"] += fsdp_f
        out["backward"] += fsdp_b
        return out

    def params_on_rank(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        dense = sum(t.params_tp / cfg.tp + t.params_rep for t in layers)
        return dense + self.expert_params_on_rank(cfg, layers) if self._experts else dense

    def stage_params_on_rank(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """Parameters of a stage's ``layers`` on one rank: a stage holding the head of a tied
        embedding without the embedding holds its own copy (autopar.runtime.pipeline: the
        last stage's copy, its gradients summed with the first stage's after the backward)."""
        return self.params_on_rank(cfg, layers) + self._tied_copy(cfg, layers)

    def _tied_copy(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        first = self.tables.layers[0].name  # the tracer counts the tied weight there
        if not self._tied or any(t.name == first for t in layers):
            return 0.0
        return self._tied / cfg.tp if any(t.vocab_logits_bytes for t in layers) else 0.0

    @staticmethod
    def expert_params_on_rank(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """The expert parameters of ``layers`` on a rank (split over max(ep, tp))."""
        return sum(t.params_expert / max(cfg.ep, cfg.tp) for t in layers)

    def _fsdp_exposed(
        self,
        cfg: ParallelConfig,
        mesh: MeshGroups,
        layers: list[LayerTable],
        st: dict[str, float],
        recomputed: frozenset[str] | None = None,
    ) -> tuple[float, float]:
        if cfg.zero_stage < 3 or cfg.fsdp == 1:
            return 0.0, 0.0
        pbytes = _PRECISION_BYTES[self.precision]
        grad_ratio = self.options.grad_bytes / pbytes
        gathers, scatters, regathers = [], [], []

        def timed(collective: str, nbytes: float) -> float:
            t = mesh.time(collective, nbytes, "fsdp")
            if not self.options.fsdp_list_copies:
                return t
            first = collective == "reduce_scatter"
            return list_collective_time_s(self.device, t, nbytes, cfg.fsdp, copies_first=first)

        for table in layers:
            size = self.params_on_rank(cfg, [table]) * pbytes
            if not size:
                continue
            # one collective per layer (FSDP units), or one per parameter tensor (ZeRO-3 as
            # DeepSpeed ran it in 2021), each paying the group's latency
            calls = table.num_param_tensors if self.options.fsdp_per_tensor else 1
            gather = size / calls
            scatter = gather * grad_ratio
            gathers.append(calls * timed("all_gather", gather))
            scatters.append(calls * timed("reduce_scatter", scatter))
            if recomputed is None or table.name in recomputed:
                regathers.append(gathers[-1])
        if not gathers:
            return 0.0, 0.0
        # backward gathers again; with full recompute the re-run forward gathers once more
        if cfg.recompute != "full":
            bwd_gathers = sum(gathers)
        elif recomputed is None:
            bwd_gathers = 2 * sum(gathers)
        else:
            bwd_gathers = sum(gathers) + sum(regathers)
        fwd_compute = st["compute_forward"] + st["tp_comm"] / 2
        bwd_compute = st["compute_backward"] + st["recompute"] + st["tp_comm"] / 2
        if not self.options.fsdp_prefetch:
            return sum(gathers), bwd_gathers + sum(scatters)
        fwd = gathers[0] + max(0.0, sum(gathers[1:]) - fwd_compute)
        bwd_comm = bwd_gathers + sum(scatters[:-1])
        bwd = scatters[-1] + max(0.0, bwd_comm - bwd_compute)
        return fwd, bwd

    def _pipeline(
        self, cfg: ParallelConfig, m: int, per_stage: list[dict[str, float]], mesh: MeshGroups
    ) -> tuple[float, list[float], int]:
        busy = [m * (s["forward"] + s["backward"]) for s in per_stage]
        busiest = max(range(len(busy)), key=busy.__getitem__)
        if cfg.pp == 1:
            return busy[0], [1.0], 0
        boundary = max(
            (t.output_bytes for t in self.tables.layers if t.kind == "block"), default=0.0
        )
        div = cfg.cp * (cfg.tp if cfg.sequence_parallel else 1)
        p2p = mesh.time("send_recv", boundary * cfg.micro_batch_size * self.act_scale / div, "pp")
        split = cfg.schedule in ("zero_bubble", "dualpipe_v")
        fwd = tuple(s["forward"] for s in per_stage)
        wgrad = tuple(s["weight_grad"] if split else 0.0 for s in per_stage)
        bin_ = tuple(s["backward"] - w for s, w in zip(per_stage, wgrad, strict=True))
        step, inflight = self._pipeline_timer(
            cfg.schedule, cfg.pp, m, fwd, bin_, wgrad, p2p, cfg.virtual_stages
        )
        share = self.cluster.compute_share
        if share < 1.0:
            # ranks in a bubble leave their slot to the busy ones: simulate at the full rate
            # with processor sharing instead of every rank at `share` all the time
            node_of, weight = self.cluster.pipeline_placement(cfg.pp)
            step = self._pipeline_timer.shared(
                cfg.schedule,
                cfg.pp,
                m,
                tuple(x * share for x in fwd),
                tuple(x * share for x in bin_),
                tuple(x * share for x in wgrad),
                p2p,
                cfg.virtual_stages,
                node_of,
                weight,
                self.cluster.profile.compute_slots,
            )
        return step, list(inflight), busiest

    def _step_tail(
        self, cfg: ParallelConfig, mesh: MeshGroups, layers: list[LayerTable], st: dict[str, float]
    ) -> dict[str, float]:
        params = self.stage_params_on_rank(cfg, layers)
        grad = params * self.options.grad_bytes
        pbytes = params * _PRECISION_BYTES[self.precision]
        sync = 0.0
        if cfg.zero_stage == 0 and cfg.dp > 1 and cfg.ep > 1:
            # the experts are left out of the dp all-reduce and summed over the ranks holding
            # the same experts after the backward (ExpertParallel.sync_gradients): exposed
            experts = self.expert_params_on_rank(cfg, layers) * self.options.grad_bytes
            dense = grad - experts
            sync = self._overlapped(mesh.time("all_reduce", dense, "dp"), dense, st)
            if cfg.dp > cfg.ep and experts:
                sync += mesh.time("all_reduce", experts, "expert_dp")
        elif cfg.zero_stage == 0 and cfg.dp > 1:
            sync = self._overlapped(mesh.time("all_reduce", grad, "dp"), grad, st)
        elif cfg.zero_stage in (1, 2):
            reduce = mesh.time("reduce_scatter", grad, "fsdp") + mesh.time(
                "all_reduce", grad / cfg.fsdp, "dp"
            )
            gather = mesh.time("all_gather", pbytes, "fsdp")
            if self.options.overlap_param_gather:
                gather = max(0.0, gather - st["forward"])
            sync = self._overlapped(reduce, grad, st) + gather
        elif cfg.zero_stage == 3 and cfg.dp > 1:
            sync = self._overlapped(mesh.time("all_reduce", grad / cfg.fsdp, "dp"), grad, st)
        tied = self._tied_copy(cfg, layers)
        if tied:  # the last stage's copy and the first stage's embedding sum their gradients
            # (Pipeline.sync_tied_gradients, after the backward): priced on the last stage
            g = tied * self.options.grad_bytes / (cfg.fsdp if cfg.zero_stage >= 1 else 1)
            sync += mesh.time("all_reduce", g, "pp")
        if cfg.cp > 1:  # each cp rank holds its sequence shard's gradient terms: the runtime
            # sums this rank's (FSDP-sharded) gradients over cp after the backward, one
            # all-reduce (autopar.runtime.context_parallel.sync_gradients)
            sync += mesh.time("all_reduce", grad / cfg.fsdp, "cp")
        sharded = params / (cfg.fsdp if cfg.zero_stage >= 1 else 1)
        opt_bytes = sharded * _OPTIMIZER_BYTES[(self.optimizer, self.precision != "fp32")]
        blocks = sum(t.kind == "block" for t in layers)
        optimizer = (
            op_time_s(self.device, "elementwise", 0.0, opt_bytes, "fp32")
            + 10 * self.device.launch_overhead_s
            # the runtime's per-layer host work in the step (profile [runtime], CPU ranks)
            + blocks * runtime_overhead_s(self.cluster.profile.optimizer_overhead_s, cfg)
        )
        clip = op_time_s(self.device, "elementwise", 0.0, sharded * 12, "fp32") + mesh.time(
            "all_reduce", 4, "world"
        )
        return {"dp_comm": sync, "optimizer": optimizer, "grad_clip": clip}

    def _overlapped(self, comm_s: float, nbytes: float, st: dict[str, float]) -> float:
        if not self.options.overlap_grad_reduce or nbytes <= 0:
            return comm_s
        last_bucket = comm_s * min(1.0, self.options.ddp_bucket_bytes / nbytes)
        return max(last_bucket, comm_s - st["backward"])

    def _breakdown(
        self,
        cfg: ParallelConfig,
        m: int,
        st: dict[str, float],
        pipe_s: float,
        tail: dict[str, float],
    ) -> dict[str, float]:
        terms = {
            "compute_forward": m * st["compute_forward"],
            "compute_backward": m * st["compute_backward"],
            "recompute": m * st["recompute"],
            "tp_comm": m * st["tp_comm"],
            "cp_comm": m * st["cp_comm"],
            "ep_comm": m * st["ep_comm"],
            "fsdp_comm": m * st["fsdp_comm"],
        }
        terms["pipeline_bubble"] = max(0.0, pipe_s - sum(terms.values()))
        terms.update(tail)
        return terms

    # ------------------------------------------------------------------ memory

    def _stage_memory(
        self,
        cfg: ParallelConfig,
        index: int,
        layers: list[LayerTable],
        inflight: float,
        recomputed: frozenset[str] | None = None,
    ) -> PeakMemory:
        params = self.stage_params_on_rank(cfg, layers)
        state = model_state_bytes(
            params,
            precision=self.precision,  # type: ignore[arg-type]
            optimizer=self.optimizer,  # type: ignore[arg-type]
            zero_stage=cfg.zero_stage,
            shard_degree=cfg.fsdp,
        )
        b, t, c = cfg.micro_batch_size, cfg.tp, cfg.cp
        per_mb = transient = logits = 0.0
        for table in layers:
            policy = cfg.recompute
            if recomputed is not None and table.name not in recomputed:
                policy = "none"
            kept, none = (self._activation_bytes(cfg, table, p) for p in (policy, "none"))
            per_mb += kept
            transient = max(transient, none - kept)
            logits += table.vocab_logits_bytes * b / (t * c) * self.act_scale * 2
        activations = per_mb * max(1.0, inflight) + transient + logits
        pbytes = _PRECISION_BYTES[self.precision]
        if cfg.zero_stage == 3:
            largest = max((self.params_on_rank(cfg, [x]) for x in layers), default=0.0)
            buffers = 2 * largest * (pbytes + self.options.grad_bytes)
        else:
            buffers = 2 * min(self.options.ddp_bucket_bytes, params * self.options.grad_bytes)
        return peak_memory(
            state,
            activation_bytes=activations,
            communication_buffer_bytes=buffers,
            reserve_fraction=self.options.reserve_fraction,
        )

    def _activation_bytes(self, cfg: ParallelConfig, table: LayerTable, policy: str) -> float:
        """One micro-batch's activations ``table`` keeps under ``policy`` on one rank: per
        shard class, divided by t*c (sharded) or c (x t with SP, replicated); cached."""
        b, t, c, sp = cfg.micro_batch_size, cfg.tp, cfg.cp, cfg.sequence_parallel
        key = (table.name, policy, b, t, c, sp, cfg.ep > 1)
        if key not in self._activation_cache:
            div = {"tp": t * c, "rep": c * (t if sp else 1), "expert": t * c}
            split = _dispatched(cfg, table).activations.get(policy, {})
            kept = sum(v * b / div[k] for k, v in split.items())
            if c > 1 and policy == "none":
                # context parallelism all-gathers K and V: the backward keeps the whole
                # sequence's, not the 1/c shard counted above (autopar.runtime.context_parallel)
                kept += sum(op.kv_bytes for op in table.attention) * b / t * (1 - 1 / c)
            self._activation_cache[key] = self.act_scale * kept
        return self._activation_cache[key]


def _dispatched(cfg: ParallelConfig, table: LayerTable) -> LayerTable:
    """The layer as the runtime runs it under ``cfg``: with ep > 1 the all-to-all dispatch
    runs each token on its top k experts only (`tables.routed_layer`); without, a
    dense-dispatch MoE runs every expert on every token, as traced."""
    return routed_layer(table) if cfg.ep > 1 else table


def linear_partition(weights: list[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty groups of ``weights`` whose largest sum is the
    smallest possible. Bisection on that largest sum with a greedy feasibility check (greedy
    filling is optimal for a given bound), then splitting groups until there are ``parts``;
    splitting never raises the maximum. O(n log(sum/eps)) instead of the O(n^2 k) table."""
    if not 1 <= parts <= len(weights):
        raise ValueError(f"cannot split {len(weights)} items into {parts} non-empty groups")

    def greedy(bound: float) -> list[list[float]]:
        groups: list[list[float]] = [[]]
        for w in weights:
            if groups[-1] and sum(groups[-1]) + w > bound:
                groups.append([])
            groups[-1].append(w)
        return groups

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(greedy(mid)) <= parts:
            hi = mid
        else:
            lo = mid
    groups = greedy(hi)
    while len(groups) < parts:
        i = max((j for j, g in enumerate(groups) if len(g) > 1), key=lambda j: sum(groups[j]))
        g = groups[i]
        groups[i : i + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [len(g) for g in groups]
