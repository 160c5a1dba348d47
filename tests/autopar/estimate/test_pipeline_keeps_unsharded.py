"""A pipeline stage kept gathered over the step (`CostOptions.pp_keeps_unsharded`: torchtitan
and autopar's runtime under PP): its FSDP collectives are paid once a step, not per
micro-batch, and it holds all of its parameters gathered and their gradients unsharded.
The memory side is measured on CPU ranks in tests/autopar/runtime/test_memory_peak.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.models import zoo

SHAPE = dict(num_layers=8, hidden=512, ffn_hidden=1536, num_heads=8, num_kv_heads=4,
             seq_len=256, vocab_size=4096)  # fmt: skip
CONFIG = ParallelConfig(pp=2, fsdp=4, zero_stage=3, micro_batch_size=1)


@pytest.fixture(scope="module")
def tables():
    model = zoo.build("llama-8b", device="meta", **SHAPE)
    return build_tables(autopar.trace(model, zoo.example_inputs("llama-8b", model)))


def _estimate(tables, keeps: bool, batch: int):
    cluster = Cluster.from_profile("dgx_h100", num_devices=8)
    options = CostOptions(pp_keeps_unsharded=keeps)
    return Estimator(tables, cluster, precision="bf16", options=options).evaluate(CONFIG, batch)


def test_fsdp_collectives_are_paid_once_a_step(tables):
    # 4 and 16 micro-batches per step (global batch over fsdp 4, micro-batch 1)
    kept = [_estimate(tables, True, b).breakdown["fsdp_comm"] for b in (16, 64)]
    per_mb = [_estimate(tables, False, b).breakdown["fsdp_comm"] for b in (16, 64)]
    assert kept[1] == pytest.approx(kept[0], rel=1e-9)
    assert per_mb[1] == pytest.approx(4 * per_mb[0], rel=1e-9)
    # the step's one gather and reduce-scatter expose what one micro-batch's did
    assert kept[0] == pytest.approx(per_mb[0] / 4, rel=1e-9)


def test_the_stage_holds_its_parameters_gathered_and_gradients_unsharded(tables):
    kept, resharded = (_estimate(tables, k, 16) for k in (True, False))
    for k, r in zip(kept.stages, resharded.stages, strict=True):
        stage = [t for t in tables.layers if t.name in set(k.layers)]
        params = sum(t.params_tp + t.params_rep for t in stage)
        # bf16 gathered parameters and fp32 gradients (CostOptions.grad_bytes 4)
        assert k.memory.communication_buffer_bytes == pytest.approx(params * (2 + 4), rel=1e-9)
        assert k.memory.communication_buffer_bytes > r.memory.communication_buffer_bytes


def test_fsdp_zero_1_and_2_under_the_pipeline_are_priced_as_its_zero_3(tables):
    # torch's pipelining runs the three alike (4 CPU ranks: 82.5 MiB under each)
    cluster = Cluster.from_profile("dgx_h100", num_devices=8)
    for keeps in (True, False):
        estimator = Estimator(
            tables, cluster, precision="bf16", options=CostOptions(pp_keeps_unsharded=keeps)
        )
        got = [estimator.evaluate(replace(CONFIG, zero_stage=z), 16) for z in (1, 2, 3)]
        assert [e.config.zero_stage for e in got] == [1, 2, 3]
        same = {(e.step_time_s, e.peak_memory_bytes) for e in got}
        assert len(same) == (1 if keeps else 3)
