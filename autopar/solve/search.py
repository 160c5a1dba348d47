"""The outer search: price every config of the space, keep the fastest that fits.

    for degrees in space.degree_choices (pipeline-free first):   (divisibility built in)
      for order in space.axis_orders(degrees), one per set of groups on the levels:
        for config in space.inner_choices(degrees, order):        (+ its per-layer variants)
            skip if dominated, or memory lower bound > capacity   (`_Bounds`, no pricing)
            per-layer recompute: k = the fewest recomputed layers per chunk that fit
                (Estimator.fewest_recomputed_layers, memory only); price k instead of all
            offload: a config without recompute that does not fit is priced again with the
                fewest offloaded blocks per chunk that fit (Estimator.fewest_offloaded_layers,
                memory only; more only add host copies)
            skip if a step lower bound > best step so far         (branch and bound:
                the busiest stage's work, and a pipeline's fill and drain chains,
                `StageTimer.step_lower_bound`, before the pipeline is simulated)
            estimate = Estimator.evaluate(config)                (cached classes, pipelines)
            feasible if estimate.peak_memory_bytes <= capacity
    best = min feasible by (step time, config text)               (deterministic ties)

Memory bound: model state and one micro-batch's activations of the average stage; the busiest
stage holds at least that, so the bound never prunes a config that would fit. Dominated: any
recompute when the same config without it fits (only slower), tensor parallelism without
sequence parallelism (the same collective volume, more memory and replicated elementwise
work; not where collectives pay per-call latency or the runtime's host overhead differs by
style: `_sp_dominates`), and of a policy's per-layer variants (recompute_layers 1..L, and
None = every layer) all but the fewest layers that fit: memory falls and time rises with the
recomputed layers (estimate/step.py), so fewer do not fit and more are slower. Same as run:
ZeRO-2 and ZeRO-3 where a pipeline keeps its stages gathered over the step
(`memory.stage_kept_gathered`), which runs and prices ZeRO-1, 2 and 3 alike
(`Estimator.as_run`); ZeRO-1 stands for the three. These claims
are checked against exhaustive enumeration (inner_choices x recompute_layer_choices) in
tests/autopar/solve. The alternatives are the fastest feasible configs of other degrees and
the fastest that did not fit, each with why it lost.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autopar.config import ParallelConfig
from autopar.errors import AutoparError
from autopar.estimate import Estimate, Estimator
from autopar.estimate.memory import dispatched, shard_divisors, stage_kept_gathered
from autopar.estimate.mesh import layout_signature
from autopar.solve.space import (
    SpaceLimits,
    axis_orders,
    degree_choices,
    empty_space_reason,
    inner_choices,
    recompute_layer_choices,
)

GiB = 2**30


class InfeasibleError(AutoparError, ValueError):
    """No configuration of the space fits the cluster's memory."""


@dataclass(frozen=True)
class SolverReport:
    num_degree_choices: int
    num_configs: int
    pruned: dict[str, int]
    num_evaluated: int
    num_feasible: int
    search_time_s: float
    trace_time_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)
    # set when the search hit its time limit: degree choices left unpriced, and the most the
    # returned plan can be slower than the best of the whole space (against the compute
    # bound: no config runs the model's FLOPs faster than the cluster's peak)
    num_unsearched: int = 0
    optimality_gap: float = 0.0

    def as_text(self, timings: bool = True) -> str:
        """One line; ``timings=False`` leaves out the wall-clock seconds (for saved plans)."""
        pruned = ", ".join(f"{k} {v}" for k, v in sorted(self.pruned.items())) or "none"
        text = (
            f"searched {self.num_degree_choices} degree choices, {self.num_configs} configs: "
            f"pruned {pruned}; evaluated {self.num_evaluated}, {self.num_feasible} fit"
        )
        if self.num_unsearched:
            text += (
                f"; STOPPED at the time limit with {self.num_unsearched} degree choices "
                f"unsearched: the plan is the best found, at most {self.optimality_gap:.0%} "
                "slower than the optimum"
            )
        if timings:
            text += f"; trace {self.trace_time_s:.2f} s, search {self.search_time_s:.2f} s"
        return text


@dataclass(frozen=True)
class SearchResult:
    best: Estimate
    alternatives: tuple[dict[str, object], ...]
    report: SolverReport


def search(
    estimator: Estimator,
    limits: SpaceLimits,
    *,
    max_alternatives: int = 5,
    progress: Callable[[int, int], None] | None = None,
    time_limit_s: float | None = None,
    incumbent_s: float | None = None,
    capacity_bytes: float | None = None,
) -> SearchResult:
    """Price the whole space; raise InfeasibleError when nothing fits.

    With ``time_limit_s``, degree choices not reached by then are left unpriced once a config
    fits; the report says how many and bounds the optimality gap. ``incumbent_s``: the step
    time of a config known to fit (what-ifs: the chosen plan on the changed cluster); configs
    that cannot beat it are pruned from the start, so only faster ones are returned
    (InfeasibleError when there are none). ``capacity_bytes``: the memory a config must fit
    in (default: the estimator's device's).
    """
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    num_unsearched = 0
    capacity = estimator.device.memory_bytes if capacity_bytes is None else capacity_bytes
    pruned: Counter[str] = Counter()
    feasible: list[Estimate] = []
    over: list[Estimate] = []
    # pipeline-free configs first: no simulation, and a good incumbent for the time bound
    degrees_list = sorted(degree_choices(limits), key=lambda d: (d[4], d))
    feasible_best: list[float] = []
    num_configs = 0
    bounds = _Bounds(estimator)
    sp_dominates = _sp_dominates(estimator) and not limits.no_sequence_parallel
    for index, degrees in enumerate(degrees_list):
        if deadline is not None and feasible and time.perf_counter() > deadline:
            num_unsearched = len(degrees_list) - index
            break
        if progress is not None:
            progress(index, len(degrees_list))
        # (config but recompute) that fit without recompute: any recompute is only slower
        settled: set[tuple] = set()
        # (config but recompute) whose no-recompute config was slower than the best already:
        # recompute only adds work to every stage, so those are slower too
        bounded: set[tuple] = set()
        # one order per set of groups on the levels; the others are counted, not built
        orders = _distinct_orders(estimator, degrees)
        num_equivalent = len(axis_orders(degrees)) - len(orders)
        first = num_configs
        # without pp the layout moves no layer between stages: memory is the same in every
        # order, so what memory decided for one order holds for the next (keys: `_memory_key`)
        fewest: dict[ParallelConfig, int | None] = {}
        over_memory: set[ParallelConfig] = set()
        for cfg in (c for o in orders for c in inner_choices(limits, degrees, o)):
            layer_choices = recompute_layer_choices(limits, cfg)
            variants = 1 + len(layer_choices)  # cfg (every layer) and its per-layer variants
            num_configs += variants
            key = _without_recompute(cfg)
            if cfg.zero_stage > 1 and stage_kept_gathered(cfg, estimator.options):
                # the pipeline runs ZeRO-1, 2 and 3 alike (`Estimator.as_run`): one price
                pruned["same as run as ZeRO-1 (a pipeline keeps its stages gathered)"] += variants
                continue
            if cfg.tp > 1 and not cfg.sequence_parallel and sp_dominates:
                # same collective volume as with SP, more memory and replicated elementwise work
                pruned["dominated (sequence parallel off)"] += variants
                continue
            if _without_recompute(_memory_key(cfg)) in settled:
                pruned["dominated (more recompute than a config that fits)"] += variants
                continue
            if key in bounded:
                pruned["slower than the best so far (bound)"] += variants
                continue
            if bounds.memory(cfg) > capacity:  # holds for the variants: they keep more
                pruned["memory (lower bound)"] += variants
                continue
            candidate = _fewest_layers(
                estimator, limits, cfg, layer_choices, capacity, pruned, fewest
            )
            if _memory_key(candidate) in over_memory:
                pruned["memory (over in another axis order)"] += 1
                continue
            best_s = min(feasible_best[:1] + ([incumbent_s] if incumbent_s else []), default=None)
            est = estimator.evaluate(candidate, limits.global_batch_size, time_bound_s=best_s)
            if est is None:
                pruned["slower than the best so far (bound)"] += 1
                if cfg.recompute == "none":
                    bounded.add(key)
                continue
            if est.peak_memory_bytes > capacity:
                over.append(est)
                over_memory.add(_memory_key(candidate))
                if cfg.recompute != "none" or not _can_offload(estimator, limits):
                    continue
                # over with every activation kept: the fewest offloaded blocks that fit
                num_configs += 1
                offloaded = _offloaded(estimator, limits, cfg, capacity, best_s)
                if offloaded is None:
                    pruned["memory (offload: no block count fits, or slower than the best)"] += 1
                    continue
                est = offloaded
            feasible.append(est)
            if cfg.recompute == "none" and not est.config.offload_layers:
                settled.add(_without_recompute(_memory_key(cfg)))
            if not feasible_best or est.step_time_s < feasible_best[0]:
                feasible_best[:] = [est.step_time_s]
        if num_equivalent:  # every order has the same configs (the space's inner choices)
            same = (num_configs - first) // len(orders) * num_equivalent
            pruned["equivalent axis order (same groups on the levels)"] += same
            num_configs += same
    if progress is not None:
        progress(len(degrees_list), len(degrees_list))
    report = SolverReport(
        num_degree_choices=len(degrees_list),
        num_configs=num_configs,
        pruned=dict(pruned),
        num_evaluated=len(feasible) + len(over),
        num_feasible=len(feasible),
        search_time_s=time.perf_counter() - start,
        num_unsearched=num_unsearched,
    )
    if not num_configs:
        raise InfeasibleError(empty_space_reason(limits))
    if not feasible:
        raise InfeasibleError(_infeasible_message(estimator, over, capacity, limits))
    ranked = sorted(feasible, key=_rank)
    best = ranked[0]
    if num_unsearched:
        # step time >= model FLOPs / (world * peak) = mfu * step time for every config
        report = replace(report, optimality_gap=1.0 - best.mfu)
    return SearchResult(best, _alternatives(best, ranked, over, capacity, max_alternatives), report)


def _sp_dominates(estimator: Estimator) -> bool:
    """Whether TP with sequence parallelism is never slower than without: true where both
    move the same bytes at bandwidth cost and run alike on the host (datasheet profiles);
    not where each collective pays its own latency (SP issues two per all-reduce: gloo) or
    the runtime's measured host overhead differs by style (`[runtime]`)."""
    profile = estimator.cluster.profile
    return not profile.runtime_overhead_s and not any(
        lv.collective_latency_s for lv in profile.levels
    )


def _can_offload(estimator: Estimator, limits: SpaceLimits) -> bool:
    """Whether the search tries offloading: the runtime runs it and the profile states the
    host copy bandwidth it is priced by."""
    return limits.offload and estimator.cluster.profile.reliability is not None


def _offloaded(
    estimator: Estimator,
    limits: SpaceLimits,
    cfg: ParallelConfig,
    capacity: float,
    best_s: float | None,
) -> Estimate | None:
    """``cfg`` (no recompute, over memory) with the fewest offloaded blocks per chunk that fit
    (`Estimator.fewest_offloaded_layers`), priced; None where no count fits or it is slower
    than ``best_s``. More offloaded blocks only add host copies, so fewer is never slower."""
    k = estimator.fewest_offloaded_layers(cfg, limits.global_batch_size, capacity)
    if k is None:
        return None
    est = estimator.evaluate(
        replace(cfg, offload_layers=k), limits.global_batch_size, time_bound_s=best_s
    )
    return est if est is not None and est.peak_memory_bytes <= capacity else None


def _fewest_layers(
    estimator: Estimator,
    limits: SpaceLimits,
    cfg: ParallelConfig,
    layer_choices: range,
    capacity: float,
    pruned: Counter[str],
    memo: dict[ParallelConfig, int | None] | None = None,
) -> ParallelConfig:
    """Of ``cfg`` (the policy on every layer) and its per-layer variants, the one to price:
    the fewest recomputed layers per chunk that fit, else ``cfg`` itself (the most frugal);
    the others are counted in ``pruned`` (module docstring: why they cannot win)."""
    if not layer_choices:
        return cfg
    key = _memory_key(cfg)
    if memo is not None and key in memo:
        k = memo[key]
    else:
        k = estimator.fewest_recomputed_layers(
            cfg, limits.global_batch_size, capacity, max_layers=layer_choices[-1]
        )
        if memo is not None:
            memo[key] = k
    if k is None:
        pruned["memory (per-layer recompute: no layer count fits)"] += len(layer_choices)
        return cfg
    pruned["memory (per-layer recompute: fewer layers than fit)"] += k - 1
    # more layers, and cfg (every layer, embedding and head too), recompute more: slower
    pruned["dominated (more recomputed layers than fit)"] += len(layer_choices) - k + 1
    return replace(cfg, recompute_layers=k)


def _memory_key(cfg: ParallelConfig) -> ParallelConfig:
    """``cfg`` as far as its memory goes: without pp the axis order moves no layer between
    stages (the balanced split weighs layer times, which the order changes), so it is left out."""
    return replace(cfg, axis_order=None) if cfg.pp == 1 else cfg


def _without_recompute(cfg: ParallelConfig) -> tuple:
    """``cfg`` less its recompute, for the search's dominance sets."""
    return (*_degrees(cfg), cfg.zero_stage, cfg.micro_batch_size, cfg.schedule,
            cfg.virtual_stages, cfg.sequence_parallel, cfg.axis_order, cfg.etp,
            cfg.pipeline_slots, cfg.async_tp, cfg.offload_layers,
            cfg.cp_attention)  # fmt: skip


def _distinct_orders(
    estimator: Estimator, degrees: tuple[int, ...]
) -> list[tuple[str, ...] | None]:
    """The space's axis orders but those whose every priced group lies on the cluster's levels
    as an earlier order's does (`layout_signature`: the same collective times, so the same
    estimates); the default order first."""
    orders = axis_orders(degrees)  # type: ignore[arg-type]
    if len(orders) == 1:
        return orders
    dp, fsdp, cp, tp, pp, ep = degrees
    seen: set[tuple] = set()
    out: list[tuple[str, ...] | None] = []
    for order in orders:
        cfg = ParallelConfig(dp=dp, fsdp=fsdp, cp=cp, tp=tp, pp=pp, ep=ep, axis_order=order)
        signature = layout_signature(estimator.cluster, cfg)
        if signature not in seen:
            out.append(order)
        seen.add(signature)
    return out


class _Bounds:
    """Cheap lower bounds on a config's peak memory: model state and one micro-batch's
    activations of the average stage (the busiest stage holds at least that), both cached."""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator
        self._activations: dict[tuple, float] = {}
        self._states: dict[tuple, float] = {}

    def memory(self, cfg: ParallelConfig) -> float:
        key = (cfg.recompute, cfg.recompute_modules, cfg.tp, cfg.cp, cfg.sequence_parallel,
               cfg.ep > 1, cfg.etp)  # fmt: skip
        if key not in self._activations:
            div = shard_divisors(cfg)
            memory = self.estimator.memory
            self._activations[key] = self.estimator.act_scale * sum(
                v / div[k]
                for table in self.estimator.tables.layers
                # as the runtime dispatches it: with ep, each token's top k experts only
                for k, v in dispatched(cfg, table)
                .activations.get(
                    memory.policy(cfg, table, None) if cfg.recompute_modules else cfg.recompute,
                    {},
                )
                .items()
            )
        activations = self._activations[key] * cfg.micro_batch_size / cfg.pp
        return self.state(cfg) + activations

    def state(self, cfg: ParallelConfig) -> float:
        """The model state of the average stage: every layer's over pp (ZeRO by
        `StageMemory.model_state`, the experts' sharding included)."""
        key = (cfg.dp, cfg.fsdp, cfg.cp, cfg.tp, cfg.pp, cfg.ep, cfg.zero_stage, cfg.etp)
        if key not in self._states:
            memory = self.estimator.memory
            layers = list(self.estimator.tables.layers)
            self._states[key] = memory.model_state(cfg, layers).total_bytes / cfg.pp
        return self._states[key]


def _rank(est: Estimate) -> tuple[float, str]:
    return (round(est.step_time_s, 12), est.config.as_text())


def _degrees(cfg: ParallelConfig) -> tuple[int, ...]:
    return (cfg.dp, cfg.fsdp, cfg.cp, cfg.tp, cfg.pp, cfg.ep)


def _alternatives(
    best: Estimate,
    ranked: list[Estimate],
    over: list[Estimate],
    capacity: float,
    limit: int,
) -> tuple[dict[str, object], ...]:
    out: list[dict[str, object]] = []
    seen = {_degrees(best.config)}
    for est in ranked[1:]:
        if _degrees(est.config) in seen:
            continue
        seen.add(_degrees(est.config))
        slower = est.step_time_s / best.step_time_s - 1
        out.append(_alt(est, f"slower by {slower:.1%}"))
        if len(out) >= limit:
            break
    for est in sorted(over, key=_rank)[:2]:
        if est.step_time_s < best.step_time_s:
            excess = (est.peak_memory_bytes - capacity) / GiB
            out.append(_alt(est, f"faster but over memory by {excess:.1f} GiB"))
    return tuple(out)


def _alt(est: Estimate, why: str) -> dict[str, object]:
    return {
        "config": est.config.as_text(),
        "step_time_s": est.step_time_s,
        "peak_memory_bytes": est.peak_memory_bytes,
        "why": why,
        "breakdown": dict(est.breakdown),  # what it loses, term by term (Plan.explain)
    }


def _infeasible_message(
    estimator: Estimator, over: list[Estimate], capacity: float, limits: SpaceLimits
) -> str:
    cluster = estimator.cluster
    if over:
        frugal = min(over, key=lambda e: e.peak_memory_bytes)
        where = (
            f"the most frugal config ({frugal.config.as_text()}) needs "
            f"{frugal.peak_memory_bytes / GiB:.1f} GiB per device"
        )
    else:
        bounds = _Bounds(estimator)
        bound = min(
            bounds.state(cfg)
            for degrees in degree_choices(limits)
            for cfg in inner_choices(limits, degrees)
        )
        where = f"even the model state alone needs at least {bound / GiB:.1f} GiB per device"
    nodes = _smallest_cluster(estimator, limits)
    hold = (
        f"the smallest cluster of {cluster.profile.name} that holds it has {nodes} nodes"
        if nodes
        else f"no cluster of up to {_MAX_NODES} nodes of {cluster.profile.name} holds it"
    )
    return (
        f"the model fits nowhere on {cluster.profile.name} x {cluster.num_nodes} nodes "
        f"({capacity / GiB:.1f} GiB per device): {where}; {hold}"
    )


_MAX_NODES = 8192


def _smallest_cluster(estimator: Estimator, limits: SpaceLimits) -> int | None:
    """Double the nodes until the most frugal config (tensor parallel across the node, ZeRO-3
    over the rest, full recompute, one sample per micro-batch) fits; None past _MAX_NODES."""
    from autopar.hardware import Cluster

    profile = estimator.cluster.profile
    per_node = estimator.cluster.devices_per_node
    tp = max(d for d in range(1, per_node + 1) if per_node % d == 0 and limits.num_heads % d == 0)
    nodes = estimator.cluster.num_nodes
    while nodes <= _MAX_NODES:
        cluster = Cluster(profile, nodes, per_node)
        fsdp = cluster.world_size // tp
        cfg = ParallelConfig(
            fsdp=fsdp,
            tp=tp,
            zero_stage=3 if fsdp > 1 else 0,
            recompute="full",
            sequence_parallel=tp > 1,
        )
        trial = Estimator(
            estimator.tables,
            cluster,
            precision=estimator.precision,
            optimizer=estimator.optimizer,
            options=estimator.options,
        )
        if trial.evaluate(cfg, fsdp).peak_memory_bytes <= profile.device.memory_bytes:
            return nodes
        nodes *= 2
    return None
