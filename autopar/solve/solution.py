"""solve: the search, its ILP refinement and the what-ifs, as one call.

In: the `RecordingEstimator` that prices configs of the traced model on the cluster, the
`ModelGraph`, the `Cluster`, the `SpaceLimits` and `PlanOptions`. Out: a `Solution`:

    search       the space's configs priced, pruned by bounds; best fitting + alternatives
                 (`autopar.solve.search`)
    refine       the best configs re-priced with the intra-layer ILP's layer costs; the winner
                 may change (`autopar.solve.refine`)
    sensitivity  the same search on 2x inter-node bandwidth and on +50% HBM
                 (`autopar.solve.whatif`), when `PlanOptions.sensitivity`

with the notes the plan carries (a search stopped at its time limit, a winner the ILP changed)
and the seconds each step took.

Raises `InfeasibleError` when nothing fits (the search's message says what was tried).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from autopar.estimate import Estimate
from autopar.hardware import Cluster
from autopar.solve.options import PlanOptions
from autopar.solve.refine import (
    RecordingEstimator,
    RefineResult,
    refine,
    refined_alternatives,
    refined_note,
)
from autopar.solve.search import SolverReport, search
from autopar.solve.space import SpaceLimits
from autopar.solve.whatif import sensitivity
from autopar.tracing import ModelGraph


@dataclass(frozen=True)
class Solution:
    best: Estimate  # after the ILP's re-pricing
    alternatives: tuple[dict[str, Any], ...]
    report: SolverReport
    refined: RefineResult
    sensitivity: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]
    timings: dict[str, float] = field(default_factory=dict)  # search, ilp, what-if seconds


def solve(
    estimator: RecordingEstimator,
    graph: ModelGraph,
    cluster: Cluster,
    limits: SpaceLimits,
    options: PlanOptions,
) -> Solution:
    """Search ``limits``' space with ``estimator``, refine the best configs with the ILP and
    re-plan on the what-if clusters (module docstring)."""
    result = search(
        estimator,
        limits,
        max_alternatives=options.max_alternatives,
        progress=options.progress,
        time_limit_s=options.time_limit_s,
    )
    t_ilp = time.perf_counter()
    batch = limits.global_batch_size
    refined = refine(
        estimator, estimator.priced, graph, cluster, batch, result.best, options.refine
    )
    t_whatif = time.perf_counter()
    what_if: tuple[dict[str, Any], ...] = ()
    if options.sensitivity:
        what_if = sensitivity(
            estimator.tables,
            cluster,
            limits,
            refined.best,
            precision=estimator.precision,
            optimizer=estimator.optimizer,
            options=options.cost,
            time_limit_s=options.time_limit_s,
            base=estimator,
        )
    notes, alternatives = [], result.alternatives
    report = result.report
    if report.num_unsearched:
        notes.append(
            f"search stopped at its time limit ({options.time_limit_s} s): "
            f"{report.num_unsearched} of {report.num_degree_choices} degree choices unsearched; "
            f"this is the best plan found, at most {report.optimality_gap:.0%} slower than the "
            "optimum (compute bound)"
        )
    if refined.changed:
        notes.append(refined_note(refined, result.best))
        alternatives = refined_alternatives(refined, result, options.max_alternatives)
    return Solution(
        best=refined.best,
        alternatives=alternatives,
        report=report,
        refined=refined,
        sensitivity=what_if,
        notes=tuple(notes),
        timings={
            "search": report.search_time_s,
            "ilp": t_whatif - t_ilp,
            "what-if": time.perf_counter() - t_whatif,
        },
    )
