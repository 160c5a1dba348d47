"""Activation offloading priced (ParallelConfig.offload_layers): the offloaded blocks' saved
activations leave the device's kept bytes (two of the largest stay as copy buffers), and their
host copies cost bytes / host bandwidth each way per micro-batch, all exposed on autopar's
runtime (save_on_cpu on the compute stream) and only what the next layer's compute does not
hide where the stack copies on a side stream (TransformerEngine's, megatron-core)."""

from __future__ import annotations

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate import Estimator, build_tables
from autopar.estimate.stacks import load_stack
from autopar.estimate.stages import offloaded_layers, stage_layers
from autopar.models import zoo


@pytest.fixture(scope="module")
def traced():
    model = zoo.build("llama-tiny", device="meta", num_layers=4)
    inputs = zoo.example_inputs("llama-tiny", model, batch_size=1)
    return build_tables(autopar.trace(model, inputs))


def _estimator(tables, stack: str) -> Estimator:
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    return Estimator(tables, cluster, options=load_stack(stack).options)


def _parts(est: Estimator, cfg: ParallelConfig):
    times = est.layer_times(cfg, est.mesh(cfg))
    chunks = est.chunks(cfg, times)
    (layers,) = stage_layers(cfg, chunks)
    return times, layers, offloaded_layers(cfg, chunks)


@pytest.mark.parametrize("stack", ["autopar", "megatron-core"])
def test_offloaded_bytes_leave_the_device_and_their_copies_are_priced(traced, stack):
    est = _estimator(traced, stack)
    plain, cfg = ParallelConfig(dp=2), ParallelConfig(dp=2, offload_layers=2)
    times, layers, off = _parts(est, cfg)
    assert sorted(off) == ["layers.0", "layers.1"]
    kept = {t.name: est.memory.activation_bytes(cfg, t, "none") for t in layers}
    before = est.memory.stage_phases(plain, layers, 1.0, None, 4)
    after = est.memory.stage_phases(cfg, layers, 1.0, None, 4, off)
    moved = sum(kept[n] for n in off)
    assert after.kept == pytest.approx(before.kept - moved)
    assert after.buffers == pytest.approx(before.buffers + 2 * max(kept[n] for n in off))
    # the step's exposed copies, per micro-batch: out in forward, back in backward
    st = est.timer.stage_times(cfg, est.mesh(cfg), layers, times, None, (), 4, off)
    rate = est.cluster.profile.reliability.host_copy_bytes_per_s
    names = [t.name for t in layers]
    want = 0.0
    for n in off:
        after_it = times[names[names.index(n) + 1]]
        for hidden in (after_it.forward_s, after_it.backward_s):
            overlap = hidden if est.options.offload_overlap else 0.0
            want += max(0.0, kept[n] / rate - overlap)
    assert st["offload"] == pytest.approx(want)
    assert est.options.offload_overlap == (stack == "megatron-core")
    base = est.timer.stage_times(plain, est.mesh(plain), layers, times, None, (), 4)
    assert st["forward"] + st["backward"] == pytest.approx(
        base["forward"] + base["backward"] + want
    )


def test_offload_shows_in_the_plan_and_its_limits_are_named(traced):
    est = _estimator(traced, "autopar")  # copies on the compute stream: all exposed
    plain = est.evaluate(ParallelConfig(dp=2), 8)
    off = est.evaluate(ParallelConfig(dp=2, offload_layers=4), 8)
    assert off.breakdown["offload"] > 0 and "offload" not in plain.breakdown
    slowest = 1 + est.cluster.straggler_share  # the step at its slowest device's pace
    want = plain.step_time_s + off.breakdown["offload"] * slowest
    assert off.step_time_s == pytest.approx(want)
    with pytest.raises(ConfigError, match="offload_layers=5 but the fullest of the 1 model"):
        est.evaluate(ParallelConfig(dp=2, offload_layers=5), 8)
