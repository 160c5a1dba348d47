"""Fitting: synthetic measurements made with known parameters give those parameters back."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from cost_models.comm import HierarchicalGroup, Level, collective_time
from cost_models.compute import EfficiencyCurve
from cost_models.fit import CommMeasurement, fit_efficiency_curve, fit_level

SIZES = np.geomspace(1e5, 1e11, 13)


def _rates(curve: EfficiencyCurve, peak: float, sizes: np.ndarray) -> np.ndarray:
    return np.array([peak * curve.at(x) for x in sizes])


def test_exact_curve_is_recovered_with_a_datasheet_peak():
    truth = EfficiencyCurve(0.62, 3e8)
    fit = fit_efficiency_curve(SIZES, _rates(truth, 989e12, SIZES), peak=989e12)
    assert fit.curve.max == pytest.approx(0.62, rel=1e-9)
    assert fit.curve.half_size == pytest.approx(3e8, rel=1e-9)
    assert fit.peak == 989e12 and fit.rms_relative_error < 1e-9
    assert fit.time_s(1e9) == pytest.approx(1e9 / (989e12 * truth.at(1e9)))


def test_without_a_peak_the_fitted_rate_is_the_peak():
    truth = EfficiencyCurve(0.5, 2e6)
    fit = fit_efficiency_curve(SIZES, _rates(truth, 2e11, SIZES))
    assert fit.peak == pytest.approx(1e11) and fit.curve.max == pytest.approx(1.0)
    assert fit.rate == pytest.approx(1e11) and fit.curve.half_size == pytest.approx(2e6)


def test_noisy_curve_is_recovered_within_the_noise():
    rng = np.random.default_rng(0)
    truth = EfficiencyCurve(0.7, 4e7)
    noisy = _rates(truth, 1e14, SIZES) * rng.lognormal(0.0, 0.05, SIZES.size)
    fit = fit_efficiency_curve(SIZES, noisy, peak=1e14)
    assert fit.curve.max == pytest.approx(0.7, rel=0.05)
    assert fit.curve.half_size == pytest.approx(4e7, rel=0.15)
    assert 0.02 < fit.rms_relative_error < 0.08  # the 5% noise, not a bad fit


def test_flat_rates_fit_a_zero_half_size():
    fit = fit_efficiency_curve([1e3, 1e6, 1e9], [7e9, 7e9, 7e9])
    assert fit.curve.half_size == pytest.approx(0.0, abs=1e-6) and fit.rate == pytest.approx(7e9)


@pytest.mark.parametrize(
    ("sizes", "rates", "match"),
    [([1e6, 1e6], [1e9, 2e9], "two distinct sizes"), ([1e6, -1], [1e9, 1e9], "must be > 0")],
)
def test_bad_curve_input_is_refused(sizes, rates, match):
    with pytest.raises(ValueError, match=match):
        fit_efficiency_curve(sizes, rates)


def test_times_that_shrink_with_size_are_refused():
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_efficiency_curve([1e3, 1e9], [1e3, 1e12])


MESSAGES = [2.0**k for k in range(10, 27, 2)]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _measure(level: Level, group_sizes, noise=0.0, seed=0) -> list[CommMeasurement]:
    rng = np.random.default_rng(seed)
    out = []
    for n in group_sizes:
        group = HierarchicalGroup((level,), (n,))
        for kind in KINDS:
            if kind == "send_recv" and n != 2:
                continue
            for s in MESSAGES:
                t = collective_time(kind, s, group).time_s * rng.lognormal(0.0, noise)
                out.append(CommMeasurement(kind, s, n, t))
    return out


def test_alpha_beta_is_recovered_from_every_collective():
    truth = Level("loopback", 0, 2.4e9, 6e-5, 1.0)
    fit = fit_level(_measure(truth, (2, 4, 8)), name="loopback", devices_per_domain=0)
    assert fit.level.latency_s == pytest.approx(6e-5, rel=1e-9)
    assert fit.level.bandwidth_bytes_per_s == pytest.approx(2.4e9, rel=1e-9)
    assert fit.level.efficiency == 1.0 and fit.rms_log_ratio < 1e-9
    # tree all-reduce wins for small messages on 8 ranks; the fit priced those with it
    assert "tree" in fit.algorithms and "ring" in fit.algorithms


def test_fitted_bandwidth_is_the_achieved_one():
    truth = Level("nvlink", 8, 450e9, 3e-6, 0.8)
    fit = fit_level(_measure(truth, (2, 8)), name="nvlink", devices_per_domain=8)
    assert fit.level.bandwidth_bytes_per_s == pytest.approx(0.8 * 450e9, rel=1e-9)
    assert fit.level.devices_per_domain == 8
    assert fit.time_s("all_reduce", 2**30, 8) == pytest.approx(
        collective_time("all_reduce", 2**30, HierarchicalGroup((truth,), (8,))).time_s
    )


def test_noisy_alpha_beta_predicts_back_what_was_measured():
    truth = Level("loopback", 0, 1.5e9, 1e-4, 1.0)
    measured = _measure(truth, (2, 4), noise=0.1, seed=1)
    fit = fit_level(measured, name="loopback", devices_per_domain=0)
    assert fit.level.latency_s == pytest.approx(1e-4, rel=0.2)
    assert fit.level.bandwidth_bytes_per_s == pytest.approx(1.5e9, rel=0.1)
    ratios = [fit.time_s(m.collective, m.message_bytes, m.group_size) / m.time_s for m in measured]
    assert min(ratios) > 0.6 and max(ratios) < 1.6
    assert "loopback" in fit.as_text()


def test_bad_comm_input_is_refused():
    with pytest.raises(ValueError, match="at least two"):
        fit_level([CommMeasurement("all_reduce", 1e6, 2, 1e-3)], name="x", devices_per_domain=0)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        fit_level([CommMeasurement("allreduce", 1e6, 2, 1e-3)] * 2, name="x", devices_per_domain=0)
    with pytest.raises(ValueError, match="group_size >= 2"):
        fit_level([CommMeasurement("all_reduce", 1e6, 1, 1e-3)] * 2, name="x", devices_per_domain=0)


def test_fit_does_not_import_torch():
    assert "cost_models.fit" in sys.modules
    import subprocess

    code = "import sys, cost_models.fit; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_per_collective_latencies_are_recovered():
    """gloo-like: send/recv pays 50 us per step, the collectives 400 us, one bandwidth."""
    from cost_models.comm import HierarchicalGroup, Level, collective_time

    truth = Level(
        "loopback",
        0,
        2e9,
        4e-4,
        1.0,
        collective_latency_s=(("send_recv", 5e-5),),
    )
    group = HierarchicalGroup((truth,), (2,))
    points = [
        CommMeasurement(kind, s, 2, collective_time(kind, s, group).time_s)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
        for s in (2**10, 2**14, 2**18, 2**22, 2**26)
    ]
    fit = fit_level(points, name="loopback", devices_per_domain=0, per_collective=True)
    got = dict(fit.level.collective_latency_s)
    assert got["send_recv"] == pytest.approx(5e-5, rel=0.05)
    assert got["all_gather"] == pytest.approx(4e-4, rel=0.05)
    assert fit.level.bandwidth_bytes_per_s == pytest.approx(2e9, rel=0.05)
    assert math.exp(fit.rms_log_ratio) < 1.05
