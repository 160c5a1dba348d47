"""solve: priced configs -> the fastest ParallelConfig that fits, and why.

    space.py     the search space: every config worth pricing, divisibility checked
    limits.py    the model's and cluster's facts that bound it (`SpaceLimits`), default batch
    search.py    the outer search: configs priced by the estimator, pruned by lower bounds
    refine.py    the best configs re-priced with the intra-layer ILP (`intra/`: per layer
                 class, the placement of every node on the tp mesh, OR-Tools CP-SAT)
    whatif.py    the same search on a cluster with faster links or more memory
    solution.py  `solve`: search -> refine -> what-ifs, one call (what `autopar.api` uses)
    options.py   `PlanOptions`

In: an `autopar.estimate.Estimator` (the cost model, built once per model and cluster) and
`SpaceLimits`. Out: a `Solution` holding `Estimate`s; `autopar.plan.build` turns it into a Plan.
"""

from __future__ import annotations

from autopar.solve.options import PlanOptions
from autopar.solve.search import InfeasibleError
from autopar.solve.solution import Solution, solve

__all__ = ["InfeasibleError", "PlanOptions", "Solution", "solve"]
