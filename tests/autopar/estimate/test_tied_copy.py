"""A tied embedding under pipeline parallelism: the last stage holds its own copy of the
weight (autopar.runtime.pipeline), priced in that stage's state and gradient sync only."""

from __future__ import annotations

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import Estimator, build_tables
from autopar.estimate.memory import tied_elements
from autopar.models import zoo


@pytest.fixture(scope="module")
def gpt():
    model = zoo.build("gpt-tiny", device="meta", num_layers=4)
    return build_tables(autopar.trace(model, zoo.example_inputs("gpt-tiny", model)))


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_last_stage_holds_the_tied_copy(gpt, zero):
    tied = tied_elements(gpt)
    assert tied > 0  # gpt-tiny ties its head to the embedding
    cluster = Cluster.from_profile("local_cpu", num_devices=4)
    est = Estimator(gpt, cluster, precision="fp32")
    cfg = ParallelConfig(fsdp=2, pp=2, zero_stage=zero, micro_batch_size=1, schedule="1f1b")
    if zero == 0:
        cfg = ParallelConfig(dp=2, pp=2, micro_batch_size=1, schedule="1f1b")
    e = est.evaluate(cfg, 8)  # ZeRO-3 gathers per layer: the head has no parameters of its own
    first, last = e.stages
    layers = {t.name: t for t in gpt.layers}
    own = [est.memory.params(cfg, [layers[n] for n in s.layers]) for s in e.stages]
    stage = [est.memory.stage_params(cfg, [layers[n] for n in s.layers]) for s in e.stages]
    assert stage[0] == own[0]
    assert stage[1] == pytest.approx(own[1] + tied)
    whole = est.memory.stage_params(cfg, list(gpt.layers))
    assert whole == est.memory.params(cfg, list(gpt.layers))  # one stage: no copy
