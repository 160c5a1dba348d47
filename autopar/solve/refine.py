"""refine: the outer search's best configs re-priced with the intra-layer ILP's layer costs.

In: the `Estimator` the search priced with (a `RecordingEstimator`, which keeps every config
that fit), the `ModelGraph`, the cluster, the global batch and `RefineOptions`. Out: a
`RefineResult`: the winner under the combined cost, every candidate with its analytic and
re-priced step and per-layer times, and the ILP's figures (solves, cache hits). Invariant:
a config without tensor parallelism, or one the ILP does not model (cp > 1; ep > 1 on a
layer with experts; etp > 1), keeps the analytic price, so with every tp = 1 nothing changes.

Candidates: the `top_k` fitting configs by analytic step time, plus the fastest fitting config
of every other tp degree (so the ILP can demote one degree in favour of another).

Combined cost of a repeated layer class L under config c with tp = t > 1 (per micro-batch of
b = c.micro_batch_size samples; `layer_cost.layer_time` gives the analytic A, the ILP's
`IntraLayerPlan` I, solved with sequence parallelism as c, b samples, c's precision):

    r          = I(t).compute_s / I(1).compute_s       how well the ILP's plan divides the work
                                                       (1 when it replicates the layer)
    compute    = (A(c with tp=1).compute - host(tp=1)) * r + host(c)
                                                       forward, backward and weight-gradient
                                                       parts each scaled by r; host: the
                                                       profile's per-layer runtime overhead
                                                       (`layer_cost.runtime_overhead_s`)
    tp comm    = I(t).communication_s * (1 - tp_comm_overlap), half forward, half backward
    recompute  = full: the new forward + its tp comm; selective: A's (memory-bound ops)

A layer plan cheaper than A(c) only because it keeps weights whole (more weight bytes per rank
than the analytic tp split, e.g. tokens split over the tp group with gradients all-reduced every
micro-batch) keeps A(c): the config's memory was not priced for it. A plan whose compute is not
divided (r >= 0.9, weights replicated) is reported as running replicated; its layer then costs
at least the tp = 1 layer, so such a tp config is never cheaper than tp = 1.

The tp = 1 compute anchors the level to the analytic (calibrated) model and the ILP decides the
tp scaling and the collectives: both price ops with `cost_models.compute.op_time_s` and
collectives with `cost_models.comm` on the same tp group (ranks 0..t-1), and the ILP prices
floating tensors at the training precision (`IntraOptions.precision`), so on a large layer
they agree within a few percent (tests/autopar/solve/test_refine.py). The re-priced layer
times then go through the same step model (`Estimator.evaluate`: stage balance, FSDP overlap,
pipeline); memory stays the analytic estimate. Layers that are not repeated blocks (embedding,
head) keep their analytic price.

Winner: min over candidates of (combined step time, config text). When it is the analytic
winner, the plan keeps its analytic estimate (the saved plan does not change) and the report
carries the combined figures beside it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.config import ParallelConfig
from autopar.estimate import Estimate, Estimator
from autopar.estimate.layer_cost import LayerTime, runtime_overhead_s
from autopar.estimate.memory import params_on_rank
from autopar.estimate.mesh import MeshGroups
from autopar.estimate.tables import LayerTable
from autopar.hardware import Cluster
from autopar.solve.intra import IntraLayerCache, IntraLayerPlan, IntraOptions, solve_layer
from autopar.tracing import ModelGraph


@dataclass(frozen=True)
class RefineOptions:
    """How many of the search's configs the intra-layer ILP re-prices.

    Attributes:
        top_k: the fastest fitting configs re-priced (0 turns the refinement off).
        best_per_tp: also re-price the fastest fitting config of each other tp degree.
        time_limit_s: CP-SAT's limit per layer solve.
    """

    top_k: int = 8
    best_per_tp: bool = True
    time_limit_s: float = 10.0

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class RecordingEstimator(Estimator):
    """An Estimator that keeps every full estimate it returns (the search's priced configs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.priced: list[Estimate] = []

    def evaluate(
        self, cfg: ParallelConfig, global_batch_size: int, *, time_bound_s: float | None = None
    ) -> Estimate | None:
        est = super().evaluate(cfg, global_batch_size, time_bound_s=time_bound_s)
        if est is not None:
            self.priced.append(est)
        return est


class RepricedEstimator(Estimator):
    """An Estimator whose repeated layers take given times: {config: {class id: LayerTime}}."""

    def __init__(
        self, base: Estimator, layer_times: Mapping[ParallelConfig, Mapping[str, LayerTime]]
    ) -> None:
        super().__init__(
            base.tables,
            base.cluster,
            precision=base.precision,
            optimizer=base.optimizer,
            options=base.options,
        )
        self._overrides = layer_times

    def layer_times(self, cfg: ParallelConfig, mesh: MeshGroups) -> dict[str, LayerTime]:
        times = super().layer_times(cfg, mesh)
        override = self._overrides.get(cfg, {})
        return {t.name: override.get(t.class_id, times[t.name]) for t in self.tables.layers}


@dataclass(frozen=True)
class Candidate:
    """One re-priced config: analytic and combined step time, per-class layer times."""

    estimate: Estimate  # combined cost (the analytic estimate when not re-priced)
    analytic: Estimate
    # class id -> (analytic, combined) seconds of one layer, one micro-batch, fwd + bwd
    layer_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    skipped: str = ""  # why the ILP did not re-price it, or kept a class's analytic price
    replicated: tuple[str, ...] = ()  # classes whose ILP plan does not divide the compute

    @property
    def change(self) -> float:
        return self.estimate.step_time_s / self.analytic.step_time_s - 1

    def as_dict(self) -> dict[str, Any]:
        """JSON values for the plan's report (no wall-clock figures: plans stay byte-equal)."""
        out: dict[str, Any] = {
            "config": self.analytic.config.as_text(),
            "analytic_step_time_s": self.analytic.step_time_s,
            "step_time_s": self.estimate.step_time_s,
            "layers": {k: {"analytic_s": a, "ilp_s": b} for k, (a, b) in self.layer_s.items()},
        }
        if self.skipped:
            out["skipped"] = self.skipped
        if self.replicated:
            out["replicated"] = list(self.replicated)
        return out


@dataclass(frozen=True)
class RefineResult:
    best: Estimate  # the analytic estimate when the winner did not change
    changed: bool
    candidates: tuple[Candidate, ...]  # ranked by combined step time
    num_solves: int
    num_cache_hits: int
    solve_time_s: float
    plans: dict[str, IntraLayerPlan]  # class id -> the winner's layer plans (tp > 1)
    cache: IntraLayerCache

    def report(self) -> dict[str, Any]:
        return {
            "num_repriced": sum(1 for c in self.candidates if c.layer_s),
            "num_candidates": len(self.candidates),
            "ilp_solves": self.num_solves,
            "cache_hits": self.num_cache_hits,
            "changed": self.changed,
            "candidates": [c.as_dict() for c in self.candidates],
        }


def candidates(priced: list[Estimate], capacity: float, options: RefineOptions) -> list[Estimate]:
    """The top_k fitting estimates by (step time, config text), plus the fastest of each other
    tp degree; in that rank order, each config once."""
    fit = sorted(
        (e for e in priced if e.peak_memory_bytes <= capacity),
        key=lambda e: (round(e.step_time_s, 12), e.config.as_text()),
    )
    chosen: dict[ParallelConfig, Estimate] = {}
    for e in fit[: options.top_k]:
        chosen.setdefault(e.config, e)
    if options.best_per_tp and options.top_k:
        for e in fit:
            if all(c.tp != e.config.tp for c in chosen):
                chosen[e.config] = e
    return sorted(chosen.values(), key=lambda e: (round(e.step_time_s, 12), e.config.as_text()))


def refine(
    estimator: Estimator,
    priced: list[Estimate],
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int,
    analytic_best: Estimate,
    options: RefineOptions | None = None,
    cache: IntraLayerCache | None = None,
) -> RefineResult:
    """Re-price the search's best configs with the ILP's layer costs (module docstring).

    Args:
        estimator: what the search priced with (its options, precision and mesh).
        priced: the search's full estimates (`RecordingEstimator.priced`).
        graph, cluster, global_batch_size: as the search had them.
        analytic_best: the search's winner (returned unchanged when it still wins).
        options: `RefineOptions`; cache: reuse ILP plans (the caller's).

    Returns:
        RefineResult; with top_k = 0 the analytic winner and no candidates.
    """
    options = options or RefineOptions()
    cache = cache if cache is not None else IntraLayerCache()
    start = time.perf_counter()
    hits0, misses0 = cache.hits, cache.misses
    capacity = estimator.device.memory_bytes
    pool = candidates(priced, capacity, options)
    if all(e.config != analytic_best.config for e in pool):
        pool.insert(0, analytic_best)
    blocks = _block_classes(estimator)
    overrides: dict[ParallelConfig, dict[str, LayerTime]] = {}
    notes: dict[ParallelConfig, tuple[dict[str, tuple[float, float]], str, tuple[str, ...]]] = {}
    for est in pool:
        cfg = est.config
        skip = _skip_reason(cfg, blocks)
        if cfg.tp == 1 or skip:
            notes[cfg] = ({}, skip, ())
            continue
        times, layer_s, replicated, whole = {}, {}, [], []
        for table in blocks:
            plan_t, plan_1 = (
                _solve(graph, table, cluster, t, cfg, estimator, options, cache)
                for t in (cfg.tp, 1)
            )
            if not (plan_t.feasible and plan_1.feasible) or plan_1.compute_s <= 0:
                continue
            analytic, new = _repriced(table, cfg, estimator, plan_t, plan_1)
            if _total(new) < _total(analytic) and plan_t.parameter_bytes > 1.05 * _weight_bytes(
                table, cfg, estimator
            ):
                # cheaper only by holding more weight bytes than the config's memory budgeted
                # (weights kept whole, tokens split): not a price this config can have
                new = analytic
                whole.append(table.class_id)
            times[table.class_id] = new
            layer_s[table.class_id] = (_total(analytic), _total(new))
            if plan_t.compute_s >= 0.9 * plan_1.compute_s:
                replicated.append(table.class_id)
        overrides[cfg] = times
        skip = "" if times else "no feasible ILP plan"
        if whole:
            skip = "its ILP plan is cheaper only with whole weights (more memory than budgeted)"
        notes[cfg] = (layer_s, skip, tuple(replicated))
    repriced = RepricedEstimator(estimator, overrides)
    ranked = []
    for est in pool:
        layer_s, skip, replicated = notes[est.config]
        new = repriced.evaluate(est.config, global_batch_size) if layer_s else est
        if new.peak_memory_bytes > capacity:  # re-balanced stages can hold other layers
            new, layer_s, skip = est, {}, "over memory once its stages are re-balanced"
        ranked.append(Candidate(new, est, layer_s, skip, replicated))
    ranked.sort(key=lambda c: (round(c.estimate.step_time_s, 12), c.analytic.config.as_text()))
    winner = ranked[0] if ranked else None
    changed = winner is not None and winner.analytic.config != analytic_best.config
    best = winner.estimate if changed else analytic_best
    plans = {}
    if best.config.tp > 1 and not _skip_reason(best.config, blocks):
        for table in blocks:
            tp = best.config.tp
            plans[table.class_id] = _solve(
                graph, table, cluster, tp, best.config, estimator, options, cache
            )
    return RefineResult(
        best=best,
        changed=changed,
        candidates=tuple(ranked),
        num_solves=cache.misses - misses0,
        num_cache_hits=cache.hits - hits0,
        solve_time_s=time.perf_counter() - start,
        plans=plans,
        cache=cache,
    )


def _block_classes(estimator: Estimator) -> list[LayerTable]:
    """One table per repeated-layer class (its first layer), in model order."""
    seen: dict[str, LayerTable] = {}
    for t in estimator.tables.layers:
        if t.kind == "block":
            seen.setdefault(t.class_id, t)
    return list(seen.values())


def _skip_reason(cfg: ParallelConfig, blocks: list[LayerTable]) -> str:
    if cfg.cp > 1:
        return "cp > 1: the ILP plans a layer on the whole sequence"
    if cfg.ep > 1 and any(t.moe_num_experts for t in blocks):
        return "ep > 1: the ILP does not place experts over an expert-parallel group"
    if cfg.etp > 1:
        return "etp > 1: the ILP does not split experts over tp"
    return ""


def intra_options(cfg: ParallelConfig, precision: str, options: RefineOptions) -> IntraOptions:
    """The ILP's options for a layer under `cfg`: its micro-batch, sequence parallelism and
    precision (recompute changes only memory, which the refinement does not budget)."""
    return IntraOptions(
        sequence_parallel=cfg.sequence_parallel,
        micro_batch_size=cfg.micro_batch_size,
        precision=precision,  # type: ignore[arg-type]
        time_limit_s=options.time_limit_s,
    )


def _solve(
    graph: ModelGraph,
    table: LayerTable,
    cluster: Cluster,
    tp: int,
    cfg: ParallelConfig,
    estimator: Estimator,
    options: RefineOptions,
    cache: IntraLayerCache,
) -> IntraLayerPlan:
    opts = intra_options(cfg, estimator.precision, options)
    if tp == 1:
        opts = replace(opts, sequence_parallel=False)
    return solve_layer(graph, table.name, cluster, tp, options=opts, cache=cache)


def _repriced(
    table: LayerTable,
    cfg: ParallelConfig,
    estimator: Estimator,
    plan_t: IntraLayerPlan,
    plan_1: IntraLayerPlan,
) -> tuple[LayerTime, LayerTime]:
    """(analytic, combined) LayerTime of `table` under `cfg` (module docstring)."""

    overheads = estimator.cluster.profile.runtime_overhead_s

    def analytic(c: ParallelConfig) -> LayerTime:  # as the search priced it
        return estimator.price_layer(
            table, c, MeshGroups(estimator.cluster, c), model_overheads=False
        )

    one = replace(cfg, tp=1, sequence_parallel=False, async_tp=False, dp=cfg.dp * cfg.tp)
    now, base = analytic(cfg), analytic(one)
    # the host's per-layer overhead (a third forward, two thirds backward) does not divide
    host_1, host = runtime_overhead_s(overheads, one), runtime_overhead_s(overheads, cfg)
    r = plan_t.compute_s / plan_1.compute_s
    tp_s = plan_t.communication_s * (1 - estimator.tp_overlap(cfg)) / 2
    fwd = (base.compute_forward_s - host_1 / 3) * r + host / 3
    if cfg.recompute == "full":
        recompute = fwd + tp_s + now.cp_forward_s + now.ep_forward_s
    else:
        recompute = now.recompute_s
    new = replace(
        now,
        compute_forward_s=fwd,
        compute_backward_s=(base.compute_backward_s - 2 * host_1 / 3) * r + 2 * host / 3,
        weight_grad_s=base.weight_grad_s * r,
        recompute_s=recompute,
        tp_forward_s=tp_s,
        tp_backward_s=tp_s,
    )
    return now, new


def _weight_bytes(table: LayerTable, cfg: ParallelConfig, estimator: Estimator) -> float:
    """Weight bytes of one layer on a rank as the analytic model holds them (split over tp;
    experts over ep only, `memory.params_on_rank`)."""
    width = estimator.act_scale * estimator.tables.traced_float_bytes
    return width * params_on_rank(cfg, [table])


def _total(lt: LayerTime) -> float:
    """Compute and tp communication of one layer, fwd + bwd (what the ILP prices)."""
    return lt.compute_forward_s + lt.compute_backward_s + lt.tp_forward_s + lt.tp_backward_s


def refined_note(refined: RefineResult, analytic_best: Estimate) -> str:
    """The plan's note when the ILP's re-pricing changed the winner."""
    win = refined.candidates[0]
    old = next(c for c in refined.candidates if c.analytic.config == analytic_best.config)
    return (
        f"the intra-layer ILP re-priced the search's {len(refined.candidates)} best configs: "
        f"{win.analytic.config.as_text()} ({win.change:+.1%}) now beats the analytic winner "
        f"{old.analytic.config.as_text()} ({old.change:+.1%})"
    )


def refined_alternatives(
    refined: RefineResult, result: Any, limit: int
) -> tuple[dict[str, object], ...]:
    """Alternatives when the winner changed: the other candidates of other degrees at their
    combined price (the analytic winner among them, saying by how much it led before), then
    the search's alternatives that were not re-priced."""
    best = refined.best
    out: list[dict[str, object]] = []
    seen = {_degrees(best.config)}
    for c in refined.candidates[1:]:
        if _degrees(c.estimate.config) in seen:
            continue
        seen.add(_degrees(c.estimate.config))
        slower = c.estimate.step_time_s / best.step_time_s - 1
        why = f"slower by {slower:.1%} once the ILP re-prices its layers"
        if c.analytic.config == result.best.config:
            why += f" (the analytic winner, {c.change:+.1%} by the ILP)"
        out.append(
            {
                "config": c.estimate.config.as_text(),
                "step_time_s": c.estimate.step_time_s,
                "peak_memory_bytes": c.estimate.peak_memory_bytes,
                "why": why,
                "breakdown": dict(c.estimate.breakdown),
            }
        )
    texts = {o["config"] for o in out} | {best.config.as_text()}
    for alt in result.alternatives:
        if alt["config"] not in texts:
            out.append(alt)
    return tuple(out[: limit + 2])


def _degrees(cfg: ParallelConfig) -> tuple[int, ...]:
    return (cfg.dp, cfg.fsdp, cfg.cp, cfg.tp, cfg.pp, cfg.ep)
