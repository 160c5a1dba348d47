"""The vocabulary of parallelism: one point of the search space, and how it is written.

    parallel.py  `ParallelConfig`: the degrees (dp, fsdp, cp, tp, pp, ep), ZeRO stage,
                 micro-batch size, pipeline schedule, recompute policy, sequence parallelism
                 and the mesh's axis order; `validate` names every broken rule with numbers
    text.py      `parse_config`: the command line's ``key=value`` text, or a config's own
                 `as_text()`, back to a ParallelConfig

Every phase speaks it: the search enumerates configs, the estimator prices them, the plan
records one and the runtime builds its mesh from it. Imports only `autopar.errors` (and the
`Cluster` type for annotations).
"""

from __future__ import annotations

from autopar.config.parallel import (
    DEFAULT_AXIS_ORDER,
    DEGREES,
    RECOMPUTE,
    RECOMPUTE_MODULES,
    SCHEDULES,
    SPLIT_BACKWARD,
    ParallelConfig,
    Recompute,
    ScheduleName,
)
from autopar.config.text import parse_config

__all__ = [
    "DEFAULT_AXIS_ORDER",
    "DEGREES",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "ParallelConfig",
    "Recompute",
    "ScheduleName",
    "parse_config",
]
