"""Profile writing without ranks: synthetic measurements of a known machine -> a profile TOML
that loads and holds that machine's numbers."""

from __future__ import annotations

import pytest
import tomllib

import autopar
from autopar.errors import ProfileError
from autopar.profiler import ProfileOptions
from autopar.profiler.comm import LevelMeasurement, LevelPlan, group_sizes
from autopar.profiler.compute import ComputeMeasurement
from autopar.profiler.document import RunInfo, capped_curves, fit_measurements, refit, render
from cost_models.comm import HierarchicalGroup, Level, collective_time
from cost_models.compute import EfficiencyCurve

T0 = 2e-6
PEAKS = {"fp32": 1e11, "bf16": 4e11}
MATMUL = EfficiencyCurve(0.9, 1e6)
ATTENTION = EfficiencyCurve(0.6, 5e6)
BANDWIDTH = 3e10
LOOPBACK = Level("loopback", 0, 2.5e9, 1e-4, 1.0)


def _compute() -> list[ComputeMeasurement]:
    out = [ComputeMeasurement("launch", "fp32", "1", 1.0, 12.0, T0)]
    for dtype, peak in PEAKS.items():
        for n in (32, 64, 128, 256, 512, 1024):
            flops = 2.0 * n**3
            t = T0 + flops / (peak * MATMUL.at(flops))
            out.append(ComputeMeasurement("matmul", dtype, f"{n}x{n}x{n}", flops, 0.0, t))
    for s in (128, 512, 2048):
        flops = 4.0 * 8 * s * s * 64
        t = T0 + flops / (PEAKS["fp32"] * ATTENTION.at(flops))
        out.append(ComputeMeasurement("attention", "fp32", f"1x8x{s}x64", flops, 0.0, t))
    for numel in (2**16, 2**20, 2**24):
        out.append(
            ComputeMeasurement(
                "copy", "fp32", str(numel), 0.0, 8.0 * numel, T0 + 8.0 * numel / BANDWIDTH
            )
        )
    return out


def _comm() -> list[LevelMeasurement]:
    group = HierarchicalGroup((LOOPBACK,), (2,))
    return [
        LevelMeasurement("loopback", kind, s, 2, collective_time(kind, s, group).time_s)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
        for s in (2**12, 2**16, 2**20, 2**24)
    ]


def _info(**changes) -> RunInfo:
    info = dict(
        name="synthetic",
        kind="cpu",
        date="2026-01-01T00:00:00+00:00",
        command="autopar profile --out synthetic.toml --nproc 2",
        machine="Test CPU, 2 cores",
        num_cores=2,
        device_name="Test CPU rank",
        memory_bytes=3 * 2**30,
        torch_version="2.13.0",
        backend="gloo",
        world_size=2,
        ranks_per_node=2,
        node_devices=8,
        threads_per_rank=1,
        wall_s=12.0,
    )
    return RunInfo(**{**info, **changes})


def test_synthetic_machine_is_recovered_and_the_profile_loads(tmp_path):
    compute, comm = _compute(), _comm()
    fits = fit_measurements(compute, comm, (LevelPlan("loopback", 0, (0, 1)),))
    path = tmp_path / "synthetic.toml"
    path.write_text(render(_info(), fits, compute, comm))

    profile = autopar.load_profile(path)
    d = profile.device
    assert d.launch_overhead_s == pytest.approx(T0, rel=1e-4)
    # the measured peak is the fitted large-size rate, so max is 1 and the rate is kept
    for dtype, peak in PEAKS.items():
        assert d.peak(dtype) == pytest.approx(peak * MATMUL.max, rel=1e-3)
    assert d.matmul.max == pytest.approx(1.0, rel=1e-3)
    assert d.matmul.half_size == pytest.approx(1e6, rel=1e-3)
    assert d.peak("fp32") * d.attention.max == pytest.approx(1e11 * 0.6, rel=1e-3)
    assert d.attention.half_size == pytest.approx(5e6, rel=1e-3)
    assert d.memory_bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=1e-3)
    (level,) = profile.levels
    assert level.latency_s == pytest.approx(1e-4, rel=1e-3)
    assert level.bandwidth_bytes_per_s == pytest.approx(2.5e9, rel=1e-3)
    assert profile.devices_per_node == 8 and profile.kind == "cpu"
    assert "more share them (node.compute_slots)" in profile.description
    assert profile.compute_slots == 2  # 2 cores, 1 thread per rank, 8 devices per node
    assert all("autopar profile --out synthetic.toml" in s for s in profile.sources.values())

    raw = tomllib.loads(path.read_text())["measured"]
    assert raw["date"].startswith("2026") and raw["torch"] == "2.13.0"
    assert len(raw["compute"]) == len(compute) and len(raw["comm"]) == len(comm)
    assert autopar.Cluster.from_profile(path).world_size == 8


def test_group_sizes_are_powers_of_two_and_the_whole_level():
    assert group_sizes(1) == ()
    assert group_sizes(2) == (2,)
    assert group_sizes(6) == (2, 4, 6)
    assert group_sizes(8) == (2, 4, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"out": "x.json"}, "must name a .toml file"),
        ({"out": "x.toml", "num_procs": 0}, "--nproc must be >= 1"),
        ({"out": "x.toml", "node_devices": 0}, "--node-devices must be >= 1"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ProfileError, match=match):
        ProfileOptions(**kwargs)


def test_memory_half_size_is_capped_by_the_small_ops():
    """Large copies alone would fit a fixed cost of 10 MB / bandwidth per op (an
    extrapolation); cached small copies measured at a few microseconds cap it at 0."""
    compute = [ComputeMeasurement("launch", "fp32", "1", 1.0, 12.0, T0)]
    for numel in (2**10, 2**14, 2**18):  # cache-resident: 4x the memory's rate
        nbytes = 8.0 * numel
        compute.append(
            ComputeMeasurement("copy", "fp32", str(numel), 0.0, nbytes, T0 + nbytes / 4 / BANDWIDTH)
        )
    for numel in (2**24, 2**26):  # beyond the caches, with a 10 MB ramp
        nbytes = 8.0 * numel
        t = T0 + (nbytes + 1e7) / BANDWIDTH
        compute.append(ComputeMeasurement("copy", "fp32", str(numel), 0.0, nbytes, t))
    compute += [m for m in _compute() if m.op in ("matmul", "attention")]
    fits = fit_measurements(compute, _comm(), (LevelPlan("loopback", 0, (0, 1)),))
    assert fits.memory.rate == pytest.approx(BANDWIDTH, rel=1e-3)
    assert fits.memory.curve.half_size == 0.0


def test_refit_reproduces_a_profile_from_its_measured_table(tmp_path):
    compute, comm = _compute(), _comm()
    fits = fit_measurements(compute, comm, (LevelPlan("loopback", 0, (0, 1)),))
    text = render(_info(), fits, compute, comm)
    again = refit(text, "synthetic")
    a, b = tomllib.loads(text), tomllib.loads(again)
    assert a["device"]["launch_overhead_s"] == b["device"]["launch_overhead_s"]
    assert a["device"]["peak_flops_per_s"]["fp32"] == pytest.approx(
        b["device"]["peak_flops_per_s"]["fp32"], rel=1e-3
    )
    assert a["topology"]["levels"][0]["latency_s"] == pytest.approx(
        b["topology"]["levels"][0]["latency_s"], rel=1e-3
    )
    assert b["node"]["compute_slots"] == 2 and b["measured"] == a["measured"]


def test_a_memory_point_slower_than_a_larger_one_is_timed_again_until_it_is_not():
    """A stalled copy (every batch slowed by another process) is retimed, its best kept; a
    point no slower than the larger ones is not measured again."""
    from autopar.profiler.compute import _retime_stalls

    def point(numel: int, seconds: float) -> ComputeMeasurement:
        return ComputeMeasurement("copy", "fp32", str(numel), 0.0, 8.0 * numel, seconds)

    true = {n: T0 + 8.0 * n / BANDWIDTH for n in (2**16, 2**20, 2**24)}
    # the middle size stalled 30x, twice over; the smallest size a little slow, not stalled
    measured = [point(2**16, true[2**16] * 1.5), point(2**20, true[2**20] * 30)]
    measured.append(point(2**24, true[2**24]))
    retimes = {2**20: [true[2**20] * 40, true[2**20] * 1.1]}
    calls, notes = [], []

    def measure(m: ComputeMeasurement) -> ComputeMeasurement:
        calls.append(int(m.shape))
        return point(int(m.shape), retimes[int(m.shape)].pop(0))

    points = _retime_stalls(measured, measure, notes.append)
    assert calls == [2**20, 2**20]  # a slower retime is not kept; the second one is
    assert [p.time_s for p in points] == [true[2**16] * 1.5, true[2**20] * 1.1, true[2**24]]
    assert notes == ["memory: retimed 1 point(s) slower than a larger one"] * 2
    # a point that stays stalled is retimed at most `rounds` times, then kept as measured
    stuck = [point(2**20, 1.0), point(2**24, true[2**24])]
    again = _retime_stalls(stuck, lambda m: point(int(m.shape), 2.0), notes.append, rounds=3)
    assert [p.time_s for p in again] == [1.0, true[2**24]]


def test_a_copy_slower_than_an_add_of_more_bytes_is_timed_again():
    """The memory curve is fitted to copies and adds together, so they are checked against
    each other: a stalled copy at the largest size bent it downward in a suite run."""
    from autopar.profiler.compute import _retime_stalls

    n = 2**24
    copy = ComputeMeasurement("copy", "fp32", str(n), 0.0, 8.0 * n, 10 * 8.0 * n / BANDWIDTH)
    add = ComputeMeasurement("add", "fp32", str(n), float(n), 12.0 * n, 12.0 * n / BANDWIDTH)
    calls = []

    def measure(m: ComputeMeasurement) -> ComputeMeasurement:
        calls.append(m.op)
        return ComputeMeasurement(m.op, m.dtype, m.shape, m.flops, m.bytes_moved,
                                  m.bytes_moved / BANDWIDTH)  # fmt: skip

    points = _retime_stalls([copy, add], measure, lambda _: None)
    assert calls == ["copy"]
    assert [p.time_s for p in points] == [8.0 * n / BANDWIDTH, 12.0 * n / BANDWIDTH]


def test_the_training_factor_scales_the_curves_to_what_a_bigger_micro_batch_measured(tmp_path):
    """Synthetic runtime measurements of a machine whose ops run at half the curves' rates,
    plus a host time per layer: the written curves' maxima are halved, and the profile (with
    the overheads measured against them) prices the micro-batch of 4 as measured, where an
    overhead measured at batch 1 alone would price it short."""
    from autopar.profiler import runtime_overhead as ro
    from autopar.profiler.runtime_overhead import RuntimeMeasurement

    compute, comm = _compute(), _comm()
    fits = fit_measurements(compute, comm, (LevelPlan("loopback", 0, (0, 1)),))
    bare_path = tmp_path / "bare.toml"
    bare_path.write_text(render(_info(), fits, compute, comm))
    bare = autopar.load_profile(bare_path)
    batch, host = ro.TRAINING_BATCH, 1e-3

    def priced(layers: int, b: int) -> float:
        return ro.predicted_s(bare, "plain", layers, 2, batch_size=b)

    runtime = [
        RuntimeMeasurement("plain", layers, 2 * priced(layers, b) + layers * host, 0.0, b)
        for layers in ro.LAYERS
        for b in (1, batch)
    ]
    assert ro.training_factor(bare, runtime, 2) == pytest.approx(0.5, rel=1e-6)

    path = tmp_path / "scaled.toml"
    path.write_text(render(_info(), fits, compute, comm, runtime))
    profile = autopar.load_profile(path)
    for curve in ("matmul", "attention", "memory"):
        assert getattr(profile.device, curve).max == pytest.approx(
            getattr(bare.device, curve).max / 2, rel=1e-3
        )
        assert "max x 0.500: the training factor" in profile.sources[f"device.efficiency.{curve}"]
    assert capped_curves(path.read_text()) == []  # scaled, nothing capped
    measured = runtime[-1].time_s  # plain, 3 layers, batch 4
    assert ro.predicted_s(profile, "plain", 3, 2, batch_size=batch) == pytest.approx(
        measured, rel=0.02
    )
    unscaled = runtime[2].time_s - priced(3, 1) + priced(3, batch)  # batch 1's overhead only
    assert unscaled < 0.9 * measured, (unscaled, measured)
    raw = tomllib.loads(path.read_text())["measured"]["runtime"]
    assert sorted(r["batch_size"] for r in raw) == [1, 1, batch, batch]
    again = tmp_path / "again.toml"  # a refit reads the batch sizes back and scales alike
    again.write_text(refit(path.read_text(), "again"))
    assert autopar.load_profile(again).device.matmul.max == pytest.approx(
        profile.device.matmul.max, rel=1e-3
    )


def test_a_training_factor_that_would_lift_a_curve_over_1_states_the_scale_it_took(tmp_path):
    """A machine whose plain layer grows ten times slower than priced (a batch of 1 and of 4
    measured alike, as under load): each curve's max stops at 1, and its source states the
    scale it took, not the factor, so dividing that scale out gives the fit back."""
    import re

    from autopar.profiler import runtime_overhead as ro
    from autopar.profiler.runtime_overhead import RuntimeMeasurement

    compute, comm = _compute(), _comm()
    fits = fit_measurements(compute, comm, (LevelPlan("loopback", 0, (0, 1)),))
    bare_path = tmp_path / "bare.toml"
    bare_path.write_text(render(_info(), fits, compute, comm))
    bare = autopar.load_profile(bare_path)
    runtime = [
        RuntimeMeasurement(
            "plain", layers, ro.predicted_s(bare, "plain", layers, 2, batch_size=b) / 10, 0.0, b
        )  # fmt: skip
        for layers in ro.LAYERS
        for b in (1, ro.TRAINING_BATCH)
    ]
    factor = ro.training_factor(bare, runtime, 2)
    assert factor == pytest.approx(10.0, rel=1e-6)
    path = tmp_path / "capped.toml"
    path.write_text(render(_info(), fits, compute, comm, runtime))
    profile = autopar.load_profile(path)
    for curve in ("matmul", "attention", "memory"):
        bare_max = getattr(bare.device, curve).max
        assert bare_max * factor > 1.0  # the cap binds on every curve
        source = profile.sources[f"device.efficiency.{curve}"]
        took = float(re.search(r"max x ([0-9.]+): the training factor of 10\.000", source)[1])
        assert getattr(profile.device, curve).max == pytest.approx(1.0)
        assert took == pytest.approx(1.0 / bare_max, rel=1e-3) and took < factor
    # what `autopar profile` warns about
    assert capped_curves(path.read_text()) == ["matmul", "attention", "memory"]
