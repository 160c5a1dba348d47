"""PlanOptions: how `autopar.parallelize` searches (the cost model's options and the search's
own knobs), passed in as one frozen dataclass."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.estimate import CostOptions
from autopar.estimate.algorithms import AlgorithmOptions
from autopar.estimate.stacks import default_cost_options
from autopar.hardware import Reliability
from autopar.solve.refine import RefineOptions


@dataclass(frozen=True)
class PlanOptions:
    """How parallelize searches: the cost model's options and the search's own knobs."""

    # autopar's own runtime (`autopar.estimate.stacks`), stage boundaries balanced
    cost: CostOptions = field(default_factory=lambda: default_cost_options(balance_stages=True))
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_alternatives: int = 5
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    # stop pricing new degree choices after this many seconds once a plan fits; the plan
    # then says it is the best found and bounds its optimality gap (None: search it all)
    time_limit_s: float | None = None
    # re-plan on 2x inter-node bandwidth and on +50% HBM for explain() (`autopar.solve.whatif`);
    # two more searches on the same cost tables
    sensitivity: bool = True
    # the search's top configs re-priced by the intra-layer ILP (`autopar.solve.refine`)
    refine: RefineOptions = field(default_factory=RefineOptions)
    # device failures and checkpoint bandwidth for the plan's goodput; None: the profile's
    reliability: Reliability | None = None
    # the training algorithms priced (synchronous, fault-tolerant groups, DiLoCo across
    # sites), the token budget and the convergence assumption (`autopar.plan.training`)
    algorithms: AlgorithmOptions = field(default_factory=AlgorithmOptions)

    def __post_init__(self) -> None:
        limit = self.time_limit_s
        if limit is not None and not (
            isinstance(limit, int | float) and math.isfinite(limit) and limit >= 0
        ):  # 0: the first plan that fits
            raise ValueError(f"time_limit_s must be a finite number of seconds >= 0, got {limit!r}")
