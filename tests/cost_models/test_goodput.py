"""Goodput under failures (cost_models.goodput): Daly's formula against a simulation of the
process, the best interval against a scan of every interval, and the limits."""

from __future__ import annotations

import math
import statistics

import pytest

from cost_models.goodput import FailureModel, best_interval, goodput, simulate, young_interval_s


@pytest.mark.parametrize("lag", [0.0, 20.0])
@pytest.mark.parametrize("interval", [30.0, 80.0, 200.0])
def test_the_formula_matches_a_simulated_run(interval, lag):
    """Ten seeded runs of 2e5 s of work (about 400 failures each): the formula within 1.5%
    of their mean, also for an asynchronous checkpoint that commits 20 s later."""
    model = FailureModel(mtbf_s=600, checkpoint_s=5, restart_s=60, commit_lag_s=lag)
    runs = [simulate(interval, model, 2e5, seed=s) for s in range(10)]
    assert goodput(interval, model) == pytest.approx(statistics.fmean(runs), rel=0.015)


def test_the_best_interval_is_the_best_of_every_interval():
    model = FailureModel(mtbf_s=3600, checkpoint_s=12, restart_s=300, commit_lag_s=30)
    step = 2.5
    steps, best = best_interval(step, model)
    scan = max(range(1, 2000), key=lambda k: goodput(k * step, model))
    assert steps == scan and best == goodput(scan * step, model)
    # Young's first-order interval is close when M >> C
    assert steps * step == pytest.approx(young_interval_s(model), rel=0.1)


def test_an_asynchronous_checkpoint_waits_for_the_previous_commit():
    model = FailureModel(mtbf_s=3600, checkpoint_s=0.5, restart_s=60, commit_lag_s=400)
    steps, _ = best_interval(10.0, model)
    assert steps * 10.0 >= 400  # Young alone would say sqrt(2 * 0.5 * 3600) = 60 s


def test_without_failures_goodput_is_the_checkpoint_share():
    model = FailureModel(mtbf_s=math.inf, checkpoint_s=1.0, restart_s=60)
    assert goodput(99.0, model) == pytest.approx(0.99)
    assert best_interval(1.0, model, max_steps=1000) == (1000, goodput(1000.0, model))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"mtbf_s": 0.0}, "mtbf_s must be >= 0 (mtbf_s > 0)"),
        ({"checkpoint_s": -1.0}, "checkpoint_s must be >= 0"),
        ({"restart_s": math.nan}, "restart_s must be finite"),
        ({"commit_lag_s": math.inf}, "commit_lag_s must be finite"),
    ],
)
def test_bad_numbers_are_refused(fields, fragment):
    values = {"mtbf_s": 100.0, "checkpoint_s": 1.0, "restart_s": 10.0, **fields}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        FailureModel(**values)
