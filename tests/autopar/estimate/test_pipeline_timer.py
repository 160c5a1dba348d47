"""The cached, normalised pipeline timer equals the direct event simulation."""

from __future__ import annotations

import random

import pytest

from autopar.estimate.pipeline_timer import PipelineTimer
from cost_models.pipeline import simulate_pipeline

CASES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("interleaved_1f1b", 3),
    ("zero_bubble", 1),
    ("dualpipe_v", 2),
]


@pytest.mark.parametrize(("schedule", "v"), CASES)
def test_timer_matches_simulation_on_uneven_stages(schedule, v):
    rng = random.Random(7)
    timer = PipelineTimer()
    for p in (2, 3, 4):
        for m in (p * 5, p * 7, p * 9):
            fwd = tuple(rng.uniform(0.5, 2.0) for _ in range(p))
            b_in = tuple(rng.uniform(0.5, 2.0) for _ in range(p))
            b_w = tuple(rng.uniform(0.0, 1.0) for _ in range(p))
            p2p = tuple(rng.uniform(0.0, 0.3) for _ in range(p))  # one per hop
            full = simulate_pipeline(
                schedule, p, m, forward_s=fwd, backward_input_s=b_in,
                backward_weight_s=b_w, p2p_s=p2p, virtual_stages=v,
            )  # fmt: skip
            step, inflight = timer(schedule, p, m, fwd, b_in, b_w, p2p, v)
            assert step == pytest.approx(full.step_time_s, rel=1e-4), (p, m)
            assert inflight == full.peak_inflight_microbatches


def test_results_are_scale_free_and_cached():
    timer = PipelineTimer()
    a, _ = timer("1f1b", 4, 32, (1.0,) * 4, (2.0,) * 4, (0.0,) * 4, (0.0,) * 4, 1)
    b, _ = timer("1f1b", 4, 32, (3.0,) * 4, (6.0,) * 4, (0.0,) * 4, (0.0,) * 4, 1)
    assert a == pytest.approx((32 + 3) * 3.0)
    assert b == pytest.approx(3 * a)
    assert len(timer._cache) == 1  # one simulation serves both: same proportions
