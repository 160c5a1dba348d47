"""The time of one step, from the layers' times: stages, the pipeline, and the step's tail.

In: per layer its `LayerTime` (`autopar.estimate.layer_cost`), the layers of each stage, the
`MeshGroups` that price collectives on the config's groups, and the `StageMemory` that counts
parameters. Out: per stage the per-micro-batch sums (`StageTimer.stage_times`), the pipeline's
time (`StageTimer.pipeline`), each stage's tail after the last backward
(`StageTimer.step_tail`) and the step's breakdown (`StageTimer.breakdown`).

    step = pipeline(stage forward/backward per micro-batch, m micro-batches)
           + max over stages (exposed data-parallel sync + optimizer step + clipping)

Stage forward per micro-batch: its layers' forward (compute + exposed TP/CP/EP) plus exposed
FSDP gathers; its backward likewise, plus the split backward's host time under zero_bubble and
dualpipe_v (blocks outside model chunk 0). The pipeline comes from `cost_models.pipeline`'s
simulation; on ranks that time-share CPU cores, from `cost_models.pipeline_shared`'s at the
full rate (a rank in a bubble leaves its core to the busy ones).

Data parallel, per stage, gradients G bytes (params on the rank x grad bytes):
    ZeRO-0   all-reduce G over dp; with ep > 1 the experts' G_e are left out of it (and of the cp
    sum) and summed over the dp x cp / ep ranks holding the same experts after the backward
    (exposed; none where that is one rank), as `autopar.runtime.expert_parallel` does; ZeRO-1/2
    reduce-scatter G over fsdp (+ all-reduce G/fsdp over dp for HSDP) then all-gather the bf16
    params; ZeRO-3 all-gathers each layer forward and backward and reduce-scatters its gradients,
    every micro-batch (one call per layer, or per parameter tensor with `fsdp_per_tensor`; with
    `fsdp_list_copies` each call also copies to or from its n per-rank views,
    `cost_models.compute.list_collective_time_s`). With ep > 1 and fsdp > 1 the experts are FSDP
    units of their own over the ranks holding the same experts ("expert_dp", dp x fsdp x cp / ep of
    them; no collective where that is one rank), the dense rest over fsdp as above.
    Overlap (none on a CPU profile: gloo runs on the compute cores): gradient reduction
    hides behind the last micro-batch's backward except the last bucket (the replicated
    all-reduce only where the stack overlaps it, `replicated_grad_overlap`), and an overlapped
    ZeRO-1/2 parameter gather behind the next forward except the first. That bucket holds the
    stage's first layer, the first to be gathered and the last whose gradients are ready, and
    buckets take whole tensors: it is the bucket size or the first layer's tensor where that is
    larger (a token embedding, vocabulary x hidden: `_edge_bucket`); FSDP gathers are
    prefetched behind the previous layer's compute (exposed: what the stage's compute cannot
    cover, plus the first gather). Hidden communication still slows the compute it overlaps
    by the stack's `comm_interference` of its time.
A stack whose ZeRO hooks run per parameter tensor (DeepSpeed) adds their host time per tensor
to each micro-batch: under ZeRO-2 and ZeRO-3 the gradient's hook (its bucket copy,
`param_hook_s`), under ZeRO-3 also four gather and release hooks (`param_fetch_hook_s`,
`FETCH_HOOK_EVENTS`).
Optimizer: memory bound, bytes per parameter by optimizer, precision, moment dtype and whether
the stack's step is fused (`optimizer_step_bytes`; an unfused step's kernel launches are taken
as hidden behind its passes' bytes), plus the runtime's per-block host time where the profile
measured it.
"""

from __future__ import annotations

from autopar.config import SPLIT_BACKWARD, ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate.layer_cost import LayerTime, runtime_overhead_s, split_backward_overhead_s
from autopar.estimate.memory import (
    PRECISION_BYTES,
    StageMemory,
    expert_replicas,
    expert_shard_ways,
    optimizer_step_bytes,
    sequence_ends_gathered,
    shared_out_experts,
    stage_kept_gathered,
    token_summed_params,
    token_ways,
)
from autopar.estimate.mesh import MeshGroups
from autopar.estimate.options import CostOptions
from autopar.estimate.pipeline_timer import PipelineTimer
from autopar.estimate.tables import LayerTable, ModelTables
from autopar.hardware import Cluster
from cost_models.compute import list_collective_time_s, op_time_s
from cost_models.pipeline_bound import step_lower_bound

StageTimes = dict[str, float]
# ZeRO-3's gather and release hooks per parameter tensor per micro-batch
# (CostOptions.param_fetch_hook_s): around the forward, and again around the backward
FETCH_HOOK_EVENTS = 4


class StageTimer:
    """Prices stages, the pipeline and the step's tail for one model on one cluster."""

    def __init__(
        self,
        tables: ModelTables,
        cluster: Cluster,
        memory: StageMemory,
        *,
        precision: str,
        optimizer: str,
        options: CostOptions,
        act_scale: float,
    ) -> None:
        self.tables = tables
        self.cluster = cluster
        self.device = cluster.profile.device
        self.memory = memory
        self.precision = precision
        self.optimizer = optimizer
        self.options = options
        self.act_scale = act_scale
        self.pipeline_timer = PipelineTimer()
        # per layer, its ZeRO-3 gather's bytes against the precision's: FSDP gathers a low-
        # precision recipe's linears already cast (1 byte, not 2) where the stack does so
        self.gather_scale: dict[str, float] = {}

    def stage_times(
        self,
        cfg: ParallelConfig,
        mesh: MeshGroups,
        layers: list[LayerTable],
        times: dict[str, LayerTime],
        recomputed: frozenset[str] | None = None,
        first_chunk: list[LayerTable] | tuple[()] = (),
        microbatches: int = 1,
        offloaded: frozenset[str] = frozenset(),
    ) -> StageTimes:
        """Per micro-batch sums of ``layers``' times, and what the stage adds to them: the
        split backward's host time (its blocks outside ``first_chunk``, model chunk 0: kept
        out of the layer times, which configs of every schedule share), exposed FSDP
        (`_fsdp_exposed`, over the step's ``microbatches``) and the ``offloaded`` blocks'
        host copies the compute does not hide (`_offload_exposed`)."""
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
        per_tensor = 0.0  # host time of the per-tensor ZeRO hooks, counted in the backward
        if cfg.zero_stage >= 2:
            per_tensor += self.options.param_hook_s
        if cfg.zero_stage == 3:
            per_tensor += FETCH_HOOK_EVENTS * self.options.param_fetch_hook_s
        if per_tensor:
            hooks = per_tensor * sum(t.num_param_tensors for t in layers)
            for key in ("compute_backward", "backward"):
                out[key] += hooks
        fsdp_f, fsdp_b = self._fsdp_exposed(cfg, mesh, layers, out, recomputed, microbatches)
        out["fsdp_comm"] = fsdp_f + fsdp_b
        out["forward"] += fsdp_f
        out["backward"] += fsdp_b
        if offloaded:
            off_f, off_b = self._offload_exposed(cfg, layers, times, recomputed, offloaded)
            out["offload"] = off_f + off_b
            out["forward"] += off_f
            out["backward"] += off_b
        return out

    def _offload_exposed(
        self,
        cfg: ParallelConfig,
        layers: list[LayerTable],
        times: dict[str, LayerTime],
        recomputed: frozenset[str] | None,
        offloaded: frozenset[str],
    ) -> tuple[float, float]:
        """The host copies of the offloaded blocks' saved activations that compute does not
        hide, forward and backward, per micro-batch, at the profile's host copy bandwidth per
        device. Where the stack copies on a side stream (`CostOptions.offload_overlap`:
        TransformerEngine's CPU offload) a block's copy out runs beside the next layer's
        forward and its copy back beside that layer's backward; else (torch's save_on_cpu,
        autopar's runtime) on the compute stream, all of it exposed."""
        reliability = self.cluster.profile.reliability
        if reliability is None:
            raise ConfigError(
                f"offload_layers={cfg.offload_layers}: profile {self.cluster.profile.name} "
                "states no host copy bandwidth ([reliability] host_copy_bytes_per_s)"
            )
        rate = reliability.host_copy_bytes_per_s
        fwd = bwd = 0.0
        for i, table in enumerate(layers):
            if table.name not in offloaded:
                continue
            nbytes = self.memory.activation_bytes(
                cfg, table, self.memory.policy(cfg, table, recomputed)
            )
            after = i + 1 < len(layers) and self.options.offload_overlap
            beside = times[layers[i + 1].name] if after else None
            copy_s = nbytes / rate
            fwd += max(0.0, copy_s - (beside.forward_s if beside else 0.0))
            bwd += max(0.0, copy_s - (beside.backward_s if beside else 0.0))
        return fwd, bwd

    def _fsdp_exposed(
        self,
        cfg: ParallelConfig,
        mesh: MeshGroups,
        layers: list[LayerTable],
        st: StageTimes,
        recomputed: frozenset[str] | None = None,
        microbatches: int = 1,
    ) -> tuple[float, float]:
        """ZeRO-3's gathers and reduce-scatters a stage cannot hide, forward and backward, per
        micro-batch; where the stage stays gathered over the step (`stage_kept_gathered`),
        one gather (the first micro-batch's forward) and one reduce-scatter (the last one's
        backward) a step, spread over its ``microbatches``."""
        if cfg.zero_stage < 3:
            return 0.0, 0.0
        pbytes = PRECISION_BYTES[self.precision]
        grad_ratio = self.options.grad_bytes / pbytes
        gathers, scatters, regathers = [], [], []

        def timed(collective: str, nbytes: float, axis: str, ways: int) -> float:
            t = mesh.time(collective, nbytes, axis)
            if not self.options.fsdp_list_copies:
                return t
            first = collective == "reduce_scatter"
            return list_collective_time_s(self.device, t, nbytes, ways, copies_first=first)

        for table in layers:
            for params, axis, ways in self._zero_parts(
                cfg, [table], self.memory.params(cfg, [table])
            ):
                size = params * pbytes
                if not size:
                    continue
                scatter_size = size
                size *= self.gather_scale.get(table.name, 1.0)
                # one collective per layer (FSDP units), or one per parameter tensor (ZeRO-3 as
                # DeepSpeed ran it in 2021), each paying the group's latency
                calls = table.num_param_tensors if self.options.fsdp_per_tensor else 1
                gather = size / calls
                scatter = scatter_size / calls * grad_ratio
                gathers.append(calls * timed("all_gather", gather, axis, ways))
                scatters.append(calls * timed("reduce_scatter", scatter, axis, ways))
                if recomputed is None or table.name in recomputed:
                    regathers.append(gathers[-1])
        if not gathers:
            return 0.0, 0.0
        # backward gathers again; with full recompute the re-run forward gathers once more;
        # neither where the stage stays gathered over the step
        kept = stage_kept_gathered(cfg, self.options)
        if kept:
            bwd_gathers = 0.0
        elif cfg.recompute != "full":
            bwd_gathers = sum(gathers)
        elif recomputed is None:
            bwd_gathers = 2 * sum(gathers)
        else:
            bwd_gathers = sum(gathers) + sum(regathers)
        fwd_compute = st["compute_forward"] + st["tp_comm"] / 2
        bwd_compute = st["compute_backward"] + st["recompute"] + st["tp_comm"] / 2
        if not self.options.fsdp_prefetch:
            fwd, bwd = sum(gathers), bwd_gathers + sum(scatters)
        else:
            fwd = gathers[0] + self._hidden(sum(gathers[1:]), fwd_compute)
            bwd = scatters[-1] + self._hidden(bwd_gathers + sum(scatters[:-1]), bwd_compute)
        return (fwd / microbatches, bwd / microbatches) if kept else (fwd, bwd)

    def _hidden(self, comm_s: float, compute_s: float) -> float:
        """What ``comm_s`` of communication overlapped with ``compute_s`` of compute adds to
        it: the part compute cannot cover, and the compute the covered part slows
        (`CostOptions.comm_interference`)."""
        covered = min(comm_s, compute_s)
        return comm_s - covered + self.options.comm_interference * covered

    def step_lower_bound(self, cfg: ParallelConfig, m: int, per_stage: list[StageTimes]) -> float:
        """A lower bound on `pipeline`'s time, without simulating (the search prunes by it):
        the busiest stage's work, and under a pipeline the forwards that must run before each
        stage starts and the backwards after it ends (`cost_models.pipeline_bound`);
        a time-shared stage runs at up to the full rate while others idle."""
        if cfg.pp == 1:
            return m * (per_stage[0]["forward"] + per_stage[0]["backward"])
        fwd, b_in, wgrad = _task_times(cfg, per_stage)
        bound = step_lower_bound(
            cfg.schedule,  # type: ignore[arg-type]
            cfg.pp,
            m,
            forward_s=fwd,
            backward_input_s=b_in,
            backward_weight_s=wgrad,
            virtual_stages=cfg.virtual_stages,
        )
        return bound * self.cluster.compute_share

    def pipeline(
        self, cfg: ParallelConfig, m: int, per_stage: list[StageTimes], mesh: MeshGroups
    ) -> tuple[float, list[float], int]:
        """The pipeline's time for ``m`` micro-batches, the micro-batches in flight per
        stage at its peak, and the busiest stage."""
        busy = [m * (s["forward"] + s["backward"]) for s in per_stage]
        busiest = max(range(len(busy)), key=busy.__getitem__)
        if cfg.pp == 1:
            return busy[0], [1.0], 0
        boundary = max(
            (t.output_bytes for t in self.tables.layers if t.kind == "block"), default=0.0
        )
        gathered = sequence_ends_gathered(cfg, self.tables, self.options)
        div = cfg.cp if gathered else token_ways(cfg)
        sent = boundary * cfg.micro_batch_size * self.act_scale / div
        p2p = mesh.hop_times("send_recv", sent)  # each hop on its own link
        if gathered:  # the chunk's ends gather the sequence (one each way)
            p2p = tuple(t + mesh.time("all_gather", sent, "tp") for t in p2p)
        fwd, bin_, wgrad = _task_times(cfg, per_stage)
        if self.options.pipeline_blocking_sends and cfg.virtual_stages == 1:
            fwd, bin_, p2p = _blocking_sends(fwd, bin_, p2p)
        step, inflight = self.pipeline_timer(
            cfg.schedule, cfg.pp, m, fwd, bin_, wgrad, p2p, cfg.virtual_stages
        )
        share = self.cluster.compute_share
        if share < 1.0:
            # ranks in a bubble leave their slot to the busy ones: simulate at the full rate
            # with processor sharing instead of every rank at `share` all the time
            node_of, weight = self.cluster.pipeline_placement(cfg.pp)
            step = self.pipeline_timer.shared(
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

    def step_tail(
        self, cfg: ParallelConfig, mesh: MeshGroups, layers: list[LayerTable], st: StageTimes
    ) -> dict[str, float]:
        """What a stage does after its last backward: exposed gradient sync (dp_comm), the
        optimizer step and gradient clipping (module docstring)."""
        params = self.memory.stage_params(cfg, layers)
        grad = params * self.options.grad_bytes
        edge = self._edge_bucket(cfg, layers)  # parameters of the first (last) bucket
        sync = 0.0
        # the experts' gradients, where ep shares them out
        experts = shared_out_experts(cfg, layers) * self.options.grad_bytes
        if cfg.zero_stage == 0 and cfg.ep > 1:
            # the experts are left out of the dp all-reduce and summed over the ranks holding
            # the same experts after the backward (ExpertParallel.sync_gradients): exposed
            dense = grad - experts
            if cfg.dp > 1:
                sync = self._replicated(mesh.time("all_reduce", dense, "dp"), dense, st, edge)
            if expert_replicas(cfg) > 1 and experts:
                sync += mesh.time("all_reduce", experts, "expert_dp")
        elif cfg.zero_stage == 0 and cfg.dp > 1:
            sync = self._replicated(mesh.time("all_reduce", grad, "dp"), grad, st, edge)
        elif cfg.zero_stage in (1, 2):
            reduce = gather = 0.0
            for n, axis, ways in self._zero_parts(cfg, layers, params):  # dense; the experts
                g = n * self.options.grad_bytes
                reduce += mesh.time("reduce_scatter", g, axis)
                if axis != "expert_dp":  # HSDP: the dense shards replicated over dp
                    reduce += mesh.time("all_reduce", g / ways, "dp")
                gather += mesh.time("all_gather", n * PRECISION_BYTES[self.precision], axis)
            if self.options.overlap_param_gather:  # all but the first bucket's, which the
                # forward waits for before it starts
                first = gather * min(1.0, self._bucket_params(edge) / params) if params else 0.0
                gather = first + self._hidden(gather - first, st["forward"])
            sync = self._overlapped(reduce, grad, st, edge) + gather
        elif cfg.zero_stage == 3 and cfg.dp > 1:  # HSDP: the dense shards over dp
            n, _, ways = self._zero_parts(cfg, layers, params)[0]
            dense = n * self.options.grad_bytes / ways
            sync = self._overlapped(mesh.time("all_reduce", dense, "dp"), grad, st, edge)
        tied = self.memory.tied_copy(cfg, layers)
        if tied:  # the last stage's copy and the first stage's embedding sum their gradients
            # (Pipeline.sync_tied_gradients, after the backward): priced on the last stage
            g = (
                tied
                * self.options.grad_bytes
                / (self.memory.shard_ways(cfg) if cfg.zero_stage else 1)
            )
            sync += mesh.time("all_reduce", g, "pp_ends")
        summed = token_summed_params(cfg, layers) * self.options.grad_bytes
        if summed:  # SP: routers and experts saw the rank's sequence shard; after the
            # backward their gradients are summed over tp (autopar.runtime.tp_apply)
            sync += mesh.time("all_reduce", summed, "tp")
        over_cp = self.options.fsdp_over_cp and cfg.zero_stage >= 1
        if cfg.cp > 1 and not over_cp:  # each cp rank holds its sequence shard's gradient
            # terms: the runtime sums this rank's (FSDP-sharded) gradients over cp after the
            # backward, one all-reduce (autopar.runtime.context_parallel.sync_gradients)
            # (the experts, folded over cp, are summed over their replicas instead)
            sync += mesh.time("all_reduce", (grad - experts) / cfg.fsdp, "cp")
        sharded = self.memory.sharded_params(cfg, layers)
        o = self.options
        opt_bytes = sharded * optimizer_step_bytes(
            self.optimizer, self.precision, o.moment_bytes, o.optimizer_fused, o.grad_bytes
        )
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

    def _shard_group(self, cfg: ParallelConfig) -> tuple[str, int]:
        """The mesh group ZeRO shards over and its size (`StageMemory.shard_ways`)."""
        ways = self.memory.shard_ways(cfg)
        return ("fsdp" if ways == cfg.fsdp else "fsdp_cp"), ways

    def _zero_parts(
        self, cfg: ParallelConfig, layers: list[LayerTable], params: float
    ) -> list[tuple[float, str, int]]:
        """(parameters, mesh axis, ways) of each set of FSDP units of ``layers`` on a rank,
        ``params`` of them in all: the dense parameters over the shard group; with ep > 1 the
        experts, their own units over the ranks holding the same experts where there are
        several (none where FSDP leaves them out: `expert_shard_ways`)."""
        experts = shared_out_experts(cfg, layers)
        parts = [(params - experts, *self._shard_group(cfg))]
        ways = expert_shard_ways(cfg)
        if experts and ways > 1:
            parts.append((experts, "expert_dp", ways))
        return parts

    def _overlapped(
        self, comm_s: float, nbytes: float, st: StageTimes, edge_params: float = 0.0
    ) -> float:
        """The part of a gradient reduction of ``nbytes`` the last micro-batch's backward
        cannot hide: the last bucket's (`_bucket_params` of ``edge_params``)."""
        if not self.options.overlap_grad_reduce or nbytes <= 0:
            return comm_s
        last = self._bucket_params(edge_params) * self.options.grad_bytes
        last_bucket = comm_s * min(1.0, last / nbytes)
        return last_bucket + self._hidden(comm_s - last_bucket, st["backward"])

    def _replicated(
        self, comm_s: float, nbytes: float, st: StageTimes, edge_params: float
    ) -> float:
        """The replicated (ZeRO-0) gradient all-reduce's exposed part: `_overlapped`, or all of
        it where the stack runs it after the backward (`CostOptions.replicated_grad_overlap`)."""
        if not self.options.replicated_grad_overlap:
            return comm_s
        return self._overlapped(comm_s, nbytes, st, edge_params)

    def _bucket_params(self, edge_params: float) -> float:
        """Parameters of the bucket holding the stage's first layer: the bucket size, or that
        layer's tensor where it is larger (module docstring)."""
        return max(self.options.ddp_bucket_bytes / self.options.grad_bytes, edge_params)

    def _edge_bucket(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """A rank's elements of one tensor of the stage's first layer with parameters (their
        mean size; a token embedding's one tensor): what the edge bucket holds at least."""
        first = next((t for t in layers if t.num_param_tensors), None)
        if first is None:
            return 0.0
        return self.memory.params(cfg, [first]) / first.num_param_tensors

    @staticmethod
    def breakdown(
        m: int, st: StageTimes, pipe_s: float, tail: dict[str, float]
    ) -> dict[str, float]:
        """The step's terms on the busiest stage ``st``; the bubble is what the pipeline's
        time adds to its work."""
        terms = {
            "compute_forward": m * st["compute_forward"],
            "compute_backward": m * st["compute_backward"],
            "recompute": m * st["recompute"],
            "tp_comm": m * st["tp_comm"],
            "cp_comm": m * st["cp_comm"],
            "ep_comm": m * st["ep_comm"],
            "fsdp_comm": m * st["fsdp_comm"],
        }
        if st.get("offload"):  # activation offloading's exposed host copies
            terms["offload"] = m * st["offload"]
        terms["pipeline_bubble"] = max(0.0, pipe_s - sum(terms.values()))
        terms.update(tail)
        return terms


def _task_times(
    cfg: ParallelConfig, per_stage: list[StageTimes]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per stage, the forward, input-gradient and weight-gradient times the pipeline's tasks
    take: the weight gradient apart only where the schedule splits the backward."""
    split = cfg.schedule in SPLIT_BACKWARD
    wgrad = tuple(s["weight_grad"] if split else 0.0 for s in per_stage)
    b_in = tuple(s["backward"] - w for s, w in zip(per_stage, wgrad, strict=True))
    return tuple(s["forward"] for s in per_stage), b_in, wgrad


def _blocking_sends(
    fwd: tuple[float, ...], b_in: tuple[float, ...], hops: tuple[float, ...]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Sends that hold their rank (`CostOptions.pipeline_blocking_sends`), for one chunk per
    rank: stage s's forward ends when its activation reached s + 1 (hop s) and its backward
    when its gradient reached s - 1 (hop s - 1), so the receivers wait no longer."""
    p = len(fwd)  # one hop per rank (`MeshGroups.hop_times`)
    fwd = tuple(f + (hops[s] if s < p - 1 else 0.0) for s, f in enumerate(fwd))
    b_in = tuple(b + (hops[s - 1] if s > 0 else 0.0) for s, b in enumerate(b_in))
    return fwd, b_in, (0.0,) * p
