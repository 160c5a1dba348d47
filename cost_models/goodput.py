"""Goodput: the share of wall time that trains, when devices fail and runs checkpoint.

A run does useful work in segments of ``interval_s`` seconds (a whole number of steps), each
followed by a checkpoint that stops training for ``checkpoint_s`` (a synchronous save; for an
asynchronous one, the copy to host memory). An asynchronous checkpoint is on disk only
``commit_lag_s`` later, so a failure loses the work since the last checkpoint that had
committed. Failures arrive as a Poisson process of mean time between failures M (the whole
job's: M = 1 / (devices x failure rate per device)); each costs a restart of ``restart_s``
(relaunch, rendezvous, load the checkpoint) and the work since the last committed checkpoint.
Failures may strike during a checkpoint or a restart too.

Daly's model of this process (J. T. Daly, "A higher order estimate of the optimum checkpoint
interval for restart dumps", FGCS 22(3), 2006, eq. 13), wall time for work W:

    T_wall = M e^{R/M} (e^{(tau + C)/M} - 1) W / tau

so goodput = W / T_wall = tau / (M e^{(R + L)/M} (e^{(tau + C)/M} - 1)), with L the commit lag
added to the restart (`goodput`): a failure within L of a checkpoint also loses the segment
before it. To first order (M >> tau, C, R) the waste is C / tau + (tau / 2 + R + L) / M, which
Young's interval tau = sqrt(2 C M) minimises; `best_interval` searches whole steps instead,
with the asynchronous constraint that a checkpoint does not start before the previous one
committed (tau >= L).

`simulate` runs the process itself (seeded), the reference the tests check the formula against.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureModel:
    mtbf_s: float  # the job's mean time between failures
    checkpoint_s: float  # training stopped per checkpoint
    restart_s: float  # relaunch, rendezvous and load after a failure
    commit_lag_s: float = 0.0  # asynchronous: on disk this long after training resumes

    def __post_init__(self) -> None:
        for name in ("mtbf_s", "checkpoint_s", "restart_s", "commit_lag_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) or (name == "mtbf_s" and value == math.inf)):
                raise ValueError(f"{name} must be finite, got {value!r}")
            if value < 0 or (name == "mtbf_s" and value == 0):
                raise ValueError(f"{name} must be >= 0 (mtbf_s > 0), got {value!r}")


def goodput(interval_s: float, model: FailureModel) -> float:
    """Useful time over wall time with a checkpoint every ``interval_s`` of work (Daly)."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    m = model.mtbf_s
    if math.isinf(m):
        return interval_s / (interval_s + model.checkpoint_s)
    segment = math.expm1((interval_s + model.checkpoint_s) / m)
    return interval_s / (m * math.exp((model.restart_s + model.commit_lag_s) / m) * segment)


def young_interval_s(model: FailureModel) -> float:
    """Young's first-order optimum, sqrt(2 C M) (J. W. Young, CACM 17(9), 1974)."""
    return math.sqrt(2 * model.checkpoint_s * model.mtbf_s)


def best_interval(step_s: float, model: FailureModel, max_steps: int = 10**7) -> tuple[int, float]:
    """(steps between checkpoints, goodput) maximising `goodput` over whole steps, at least
    the commit lag apart. Goodput is unimodal in the interval: a golden-section search on
    the step count, then the neighbours checked."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    lowest = max(1, math.ceil(model.commit_lag_s / step_s))
    if math.isinf(model.mtbf_s):
        return max_steps, goodput(max_steps * step_s, model)
    lo, hi = lowest, max(lowest, min(max_steps, 4 * math.ceil(
        max(young_interval_s(model), model.commit_lag_s, step_s) / step_s)))  # fmt: skip

    def value(k: int) -> float:
        return goodput(k * step_s, model)

    while hi - lo > 3:
        a = lo + (hi - lo) // 3
        b = hi - (hi - lo) // 3
        if value(a) < value(b):
            lo = a
        else:
            hi = b
    best = max(range(lo, hi + 1), key=value)
    return best, value(best)


def simulate(interval_s: float, model: FailureModel, work_s: float, seed: int = 0) -> float:
    """Goodput of one simulated run of ``work_s`` seconds of work: exponential failure times;
    a failure anywhere (working, checkpointing, restarting) loses the work since the last
    committed checkpoint and restarts. The check on `goodput`."""
    rng = random.Random(seed)
    clock = done = committed = 0.0
    pending: list[tuple[float, float]] = []  # asynchronous checkpoints: (commits at, work)
    next_failure = rng.expovariate(1 / model.mtbf_s)
    while done < work_s:
        work = min(interval_s, work_s - done)
        last = done + work >= work_s
        end = clock + work + (0.0 if last else model.checkpoint_s)
        if next_failure < end:
            clock = next_failure
            committed = max([committed, *(w for t, w in pending if t <= clock)])
            pending, done = [], committed
            while True:  # restart; a failure during it starts it again
                next_failure = clock + rng.expovariate(1 / model.mtbf_s)
                if next_failure >= clock + model.restart_s:
                    clock += model.restart_s
                    break
                clock = next_failure
            continue
        clock, done = end, done + work
        if last:
            break
        pending.append((clock + model.commit_lag_s, done))
        committed = max([committed, *(w for t, w in pending if t <= clock)])
        pending = [(t, w) for t, w in pending if t > clock]
    return work_s / clock
