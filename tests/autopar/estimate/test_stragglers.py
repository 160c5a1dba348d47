"""A synchronous step at its slowest device's pace (`Cluster.straggler_share`): the expected
slowest of n devices against sampled ones, the profile field that sets the spread, and the
term the estimate adds."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import autopar
from autopar import ProfileError, load_profile
from autopar.config import ParallelConfig
from autopar.estimate import Estimator, build_tables
from autopar.hardware.profile import GPU_SPEED_SPREAD
from autopar.models import zoo


@pytest.mark.parametrize("nodes", [1, 2, 16, 256])
def test_the_slowest_device_against_sampled_clusters(nodes):
    """The share against the mean over 4,000 sampled clusters of the slowest device's excess
    (each device's speed a normal draw of the profile's spread): within 3% from 8 devices
    (sampling adds about 1%), where Blom's approximation is within 1% of the exact value."""
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=nodes)
    spread = cluster.profile.speed_spread
    assert spread == GPU_SPEED_SPREAD > 0
    draws = np.random.default_rng(0).standard_normal((4000, cluster.world_size))
    sampled = spread * draws.max(axis=1).mean()
    assert cluster.straggler_share == pytest.approx(sampled, rel=0.03)


def test_no_stragglers_on_one_device_a_tpu_slice_or_cpu_ranks():
    assert autopar.Cluster.from_profile("dgx_h100", num_devices=1).straggler_share == 0.0
    assert autopar.Cluster.from_profile("tpu_v5p", slice_shape=(4, 4, 4)).straggler_share == 0.0
    assert autopar.Cluster.from_profile("local_cpu", 1, num_devices=4).straggler_share == 0.0


def _with_spread(tmp_path: Path, value: str) -> Path:
    text = Path(load_profile("dgx_h100").path).read_text()
    text = re.sub(r"(?m)^\[device\]\n", f"[device]\nspeed_spread = {value}\n", text, count=1)
    path = tmp_path / "spread.toml"
    path.write_text(text)
    return path


def test_a_profile_states_its_own_spread_or_is_refused_naming_it(tmp_path):
    assert load_profile(_with_spread(tmp_path, "0.02")).speed_spread == 0.02
    assert load_profile(_with_spread(tmp_path, "0")).speed_spread == 0.0
    for bad, words in (("-0.01", "must be >= 0"), ("1.5", r"must be in \[0, 1\)")):
        with pytest.raises(ProfileError, match=rf"device.speed_spread: {words}, got"):
            load_profile(_with_spread(tmp_path, bad))


def test_the_estimate_adds_the_slowest_devices_share_of_the_step():
    """The same plan on a cluster of identical devices and on the profile's: the step longer
    by the share exactly, the difference a term of its own in the breakdown, which still sums
    to the step."""
    model = zoo.build("llama-tiny", device="meta", num_layers=4)
    tables = build_tables(autopar.trace(model, zoo.example_inputs("llama-tiny", model)))
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    even = replace(cluster, profile=replace(cluster.profile, speed_spread=0.0))
    cfg = ParallelConfig(dp=4, tp=4, micro_batch_size=1)
    spread = Estimator(tables, cluster).evaluate(cfg, 16)
    alike = Estimator(tables, even).evaluate(cfg, 16)
    assert "stragglers" not in alike.breakdown
    share = cluster.straggler_share
    assert spread.step_time_s == pytest.approx(alike.step_time_s * (1 + share))
    assert spread.breakdown["stragglers"] == pytest.approx(alike.step_time_s * share)
    assert sum(spread.breakdown.values()) == pytest.approx(spread.step_time_s)
