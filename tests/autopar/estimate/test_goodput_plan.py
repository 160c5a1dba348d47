"""A plan's goodput under failures (autopar.estimate.goodput): priced from the profile's
[reliability] table or the user's, its intervals the best whole numbers of steps, reported in
the summary and explain(), and taken by the generated program's --checkpoint-every auto."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.estimate.goodput import STATE_BYTES_PER_PARAM
from autopar.hardware import Reliability
from autopar.models import zoo
from autopar.runtime.checkpoint import checkpoint_interval
from cost_models.goodput import FailureModel, goodput


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama-tiny", device="meta")
    return model, autopar.trace(model, zoo.example_inputs("llama-tiny", model))


def _plan(llama, profile="dgx_h100", nodes=4, **kw):
    model, graph = llama
    cluster = autopar.Cluster.from_profile(profile, nodes)
    config = autopar.ParallelConfig(dp=cluster.world_size // 2, tp=2, micro_batch_size=1)
    return autopar.evaluate(
        model, cluster, config, global_batch_size=cluster.world_size, graph=graph, **kw
    )


def test_the_plan_prices_checkpoints_and_restarts_from_the_profile(llama):
    plan = _plan(llama)
    rel = autopar.load_profile("dgx_h100").reliability
    g = plan.goodput
    n = plan.world_size
    assert g["mtbf_s"] == pytest.approx(3600 / (n * rel.failure_rate_per_device_hour))
    assert g["checkpoint_bytes"] == plan.num_params * STATE_BYTES_PER_PARAM["adamw"]
    write = g["checkpoint_bytes"] / (n * rel.storage_bytes_per_s_per_device)
    assert g["commit_lag_s"] == pytest.approx(write)
    assert g["restart_s"] == pytest.approx(rel.restart_s + write)
    assert g["sync_checkpoint_s"] == pytest.approx(g["async_checkpoint_s"] + write)
    # the intervals are the best of every whole number of steps
    sync = FailureModel(g["mtbf_s"], g["sync_checkpoint_s"], g["restart_s"])
    best = g["sync_interval_steps"]

    def at(k):
        return goodput(k * plan.step_time_s, sync)

    # goodput is unimodal in the interval: no neighbour and no point of a wide grid beats it
    grid = [max(1, round(best * 2 ** (e / 4))) for e in range(-40, 41)]
    assert all(at(best) >= at(k) for k in [best - 1, best + 1, *grid])
    assert g["sync_goodput"] == pytest.approx(at(best))
    assert 0 < g["sync_goodput"] < 1 and 0 < g["async_goodput"] < 1


def test_more_failures_checkpoint_more_often_and_lose_more(llama):
    rel = autopar.load_profile("dgx_h100").reliability
    often = replace(rel, failure_rate_per_device_hour=rel.failure_rate_per_device_hour * 100)
    base, failing = _plan(llama), _plan(llama, reliability=often)
    assert failing.goodput["mtbf_s"] == pytest.approx(base.goodput["mtbf_s"] / 100)
    assert failing.goodput["sync_interval_steps"] < base.goodput["sync_interval_steps"]
    assert failing.goodput["sync_goodput"] < base.goodput["sync_goodput"]


def test_a_profile_without_failure_data_prices_none_and_says_so(llama):
    model, graph = llama
    cluster = autopar.Cluster.from_profile("tpu_v5p", slice_shape=(2, 2, 1))
    config = autopar.ParallelConfig(dp=4, micro_batch_size=1)
    plan = autopar.evaluate(model, cluster, config, global_batch_size=4, graph=graph)
    assert plan.goodput == {}
    assert "Failures: not priced" in plan.explain() and "goodput" not in plan.summary()
    mine = Reliability(1e-4, 60.0, 1e9, 1e10, 1.0)
    priced = autopar.evaluate(
        model, cluster, config, global_batch_size=4, graph=graph, reliability=mine
    )
    assert priced.goodput["mtbf_s"] == pytest.approx(3600 / (4 * 1e-4))


def test_the_summary_explain_and_program_use_it(llama, tmp_path):
    plan = _plan(llama)
    g = plan.goodput
    assert f"every {int(g['async_interval_steps'])} steps" in plan.summary()
    assert "Failures: MTBF" in plan.explain() and "--checkpoint-every auto" in plan.explain()
    assert checkpoint_interval("auto", True, g) == g["async_interval_steps"]
    assert checkpoint_interval("auto", False, g) == g["sync_interval_steps"]
    assert checkpoint_interval("auto", False, {}) == 100
    assert checkpoint_interval("7", False, g) == 7
    with pytest.raises(ValueError, match="step count or auto, got 'often'"):
        checkpoint_interval("often", False, g)
    again = autopar.Plan.from_json(plan.to_json())
    assert again.goodput == g
