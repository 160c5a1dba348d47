"""Pipelines on time-shared CPU ranks: the estimator prices them with processor sharing
(cost_models.pipeline_shared), so a stage in a bubble leaves its core to the busy ones."""

from __future__ import annotations

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import Estimator, build_tables
from autopar.models import zoo
from cost_models.pipeline import simulate_pipeline


@pytest.fixture(scope="module")
def tables():
    model = zoo.build("llama-tiny", device="meta", num_layers=4)
    return build_tables(autopar.trace(model, zoo.example_inputs("llama-tiny", model)))


def test_share_and_placement():
    two, four = (Cluster.from_profile("local_cpu", num_devices=n) for n in (2, 4))
    assert two.compute_share == 1.0 and four.compute_share == 0.5
    assert four.pipeline_placement(2) == ((0, 0), (2.0, 2.0))
    assert four.pipeline_placement(4) == ((0, 0, 0, 0), (1.0,) * 4)
    h100 = Cluster.from_profile("dgx_h100", num_nodes=2)
    assert h100.compute_share == 1.0
    # 16 devices, pp 4: two stages per node; pp 2 over 4 nodes: a stage spans two nodes
    assert h100.pipeline_placement(4) == ((0, 0, 1, 1), (4.0,) * 4)
    wide = Cluster.from_profile("dgx_h100", num_nodes=4)
    assert wide.pipeline_placement(2) == ((0, 1), (8.0, 8.0))


def test_one_micro_batch_runs_each_stage_at_the_full_rate(tables):
    """PP4 with one micro-batch on 4 ranks of 2 slots: one stage computes at a time, so the
    pipeline takes the stages' full-rate times in a row, half what sharing all the time
    prices (each stage's time on the time-shared profile)."""
    cluster = Cluster.from_profile("local_cpu", num_devices=4)
    cfg = ParallelConfig(pp=4, micro_batch_size=8, schedule="gpipe")
    est = Estimator(tables, cluster, precision="fp32").evaluate(cfg, 8)
    assert est.num_microbatches == 1
    fwd = [s.forward_s for s in est.stages]
    bwd = [s.backward_s for s in est.stages]
    always_shared = simulate_pipeline(
        "gpipe", 4, 1, forward_s=fwd, backward_input_s=bwd, backward_weight_s=[0.0] * 4
    ).step_time_s
    pipe = est.step_time_s - _tail(est)
    # half of sharing all the time, plus six p2p hops (not halved: a latency)
    assert 0.5 * always_shared < pipe < 0.6 * always_shared


def _tail(est) -> float:
    b = est.breakdown
    return sum(b.get(k, 0.0) for k in ("dp_comm", "optimizer", "grad_clip"))


def test_all_ranks_busy_prices_as_before(tables):
    """With slots to spare (2 ranks on 2 cores) a pipeline is the plain simulation of its
    stages; without a pipeline (dp 4) every rank computes all the time at half the rate."""
    for world, cfg in (
        (4, ParallelConfig(dp=4, micro_batch_size=1)),
        (2, ParallelConfig(pp=2, micro_batch_size=1, schedule="1f1b")),
    ):
        cluster = Cluster.from_profile("local_cpu", num_devices=world)
        a = Estimator(tables, cluster, precision="fp32").evaluate(cfg, 8)
        if cfg.pp > 1:
            s = a.stages
            t = simulate_pipeline(
                "1f1b", 2, a.num_microbatches,
                forward_s=[x.forward_s for x in s], backward_input_s=[x.backward_s for x in s],
                backward_weight_s=[0.0, 0.0],
            ).step_time_s  # fmt: skip
            assert a.step_time_s - _tail(a) == pytest.approx(t, rel=0.02)
        else:
            b = a.breakdown
            busy = b["compute_forward"] + b["compute_backward"]
            assert a.step_time_s - _tail(a) == pytest.approx(busy, rel=1e-6)


def test_time_bound_never_prunes_a_faster_pipeline(tables):
    """The search's bound (busiest stage's work) must stay a lower bound when bubbles give
    cores back: a bound just above the priced step keeps the config."""
    cluster = Cluster.from_profile("local_cpu", num_devices=4)
    est = Estimator(tables, cluster, precision="fp32")
    for cfg in (  # busiest stage's time-shared work: 89 ms and 730 ms, priced 68 and 655
        ParallelConfig(pp=4, micro_batch_size=1, schedule="gpipe"),
        ParallelConfig(pp=2, tp=2, micro_batch_size=1, schedule="gpipe"),
    ):
        step = est.evaluate(cfg, 8).step_time_s
        assert est.evaluate(cfg, 8, time_bound_s=step * 1.0001) is not None
