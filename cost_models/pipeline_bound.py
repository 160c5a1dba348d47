"""A lower bound on a pipeline's step, without simulating it: the search prunes by it.

In: what `cost_models.pipeline.simulate_pipeline` takes (p2p latency taken as 0). Out: a time
no larger than the simulated step. Rank s's first task is an F of some virtual stage j0, which
waits for the same micro-batch's F on stages 0 .. j0 - 1, one after another; where its last
task is a B of stage j, the same micro-batch's B on stages j - 1 .. 0 run after it, one after
another. So the step is at least those F chains + rank s's busy time + those B chains, for
every s. For uniform 1F1B stages this is the step, (p - 1)(f + b) + m (f + b); checked
against the simulation on random pipelines of every schedule (tests/cost_models).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

from cost_models.pipeline import _SCHEDULES, Schedule, _checked


@functools.lru_cache(maxsize=4096)
def _chains(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, (the ranks of the virtual stages before its first task's, the ranks of those
    before its last task's where that task is a B, else none): the F chain that must run
    before the rank starts and the B chain that must run after it ends. A pure memo, read off
    the schedule's order without keeping it (the search bounds many more (m, v) than it
    simulates, and `_prepared` keeps every task)."""
    spec = _SCHEDULES[schedule]
    rank_of = {spec.layout(s, k, p): s for s in range(p) for k in range(v)}
    out = []
    for s in range(p):
        order = spec.order(s, p, m, v)
        first = next(order)
        (last,) = collections.deque(order, maxlen=1)  # every F has a B after it
        j0, j = spec.layout(s, first[2], p), spec.layout(s, last[2], p)
        before = tuple(rank_of[k] for k in range(j0))
        after = tuple(rank_of[k] for k in range(j)) if last[0] == "B" else ()
        out.append((before, after))
    return tuple(out)


def step_lower_bound(
    schedule: Schedule,
    num_stages: int,
    num_microbatches: int,
    *,
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    virtual_stages: int | None = None,
) -> float:
    """A lower bound on `simulate_pipeline`'s step time (same arguments, p2p latency taken as
    0), without simulating (module docstring)."""
    spec, v, durations = _checked(
        schedule, num_stages, num_microbatches, virtual_stages,
        forward_s, backward_input_s, backward_weight_s, 0.0,
    )  # fmt: skip
    m = int(num_microbatches)
    bound = 0.0
    for s, (before, after) in enumerate(_chains(schedule, int(num_stages), m, v)):
        d = durations[s]
        busy = m * v * (d["F"] + d["B"] + (d["W"] if spec.splits_backward else 0.0))
        chain = sum(durations[r]["F"] for r in before) + sum(durations[r]["B"] for r in after)
        bound = max(bound, chain + busy)
    return bound
