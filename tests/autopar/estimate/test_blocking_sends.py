"""Pipeline sends that hold their rank (`CostOptions.pipeline_blocking_sends`: Megatron's
non-interleaved 1F1B waits on each send before its next micro-batch): every micro-batch of a
middle stage pays one hop each way on top of its compute, where sends that run beside the
next task only delay their receiver."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.mesh import MeshGroups
from autopar.models import zoo

SHAPE = dict(num_layers=8, hidden=1024, ffn_hidden=2816, num_heads=8, num_kv_heads=8,
             seq_len=1024, vocab_size=4096)  # fmt: skip
PP = 4
CONFIG = ParallelConfig(pp=PP, dp=2, micro_batch_size=1, recompute="none")


@pytest.fixture(scope="module")
def tables():
    model = zoo.build("llama-8b", device="meta", **SHAPE)
    return build_tables(autopar.trace(model, zoo.example_inputs("llama-8b", model)))


def _estimate(tables, blocking: bool, microbatches: int, cfg: ParallelConfig = CONFIG):
    # A10G nodes: no peer-to-peer path, so a send is slow against a small model's compute
    cluster = Cluster.from_profile("aws_g5_a10g", num_devices=8)
    options = CostOptions(pipeline_blocking_sends=blocking)
    estimator = Estimator(tables, cluster, precision="bf16", options=options)
    return estimator.evaluate(cfg, cfg.dp * microbatches)


def _step(tables, blocking: bool, microbatches: int, cfg: ParallelConfig = CONFIG) -> float:
    return _estimate(tables, blocking, microbatches, cfg).step_time_s


def _hop(cfg: ParallelConfig = CONFIG) -> float:
    """One activation's send between neighbouring stages: the sequence of one sample, bf16."""
    cluster = Cluster.from_profile("aws_g5_a10g", num_devices=8)
    sent = SHAPE["seq_len"] * SHAPE["hidden"] * 2 * cfg.micro_batch_size
    return max(MeshGroups(cluster, cfg).hop_times("send_recv", sent))


def test_a_stage_runs_no_faster_than_its_compute_and_its_held_sends(tables):
    hop = _hop()
    assert hop > 1e-3  # over PCIe through the host: milliseconds, not noise
    stages = _estimate(tables, True, 32).stages
    # a middle stage sends each micro-batch's activation on and its gradient back
    busiest = max(s.forward_s + s.backward_s + 2 * hop for s in stages[1:-1])
    steps = {held: [_step(tables, held, m) for m in (32, 64)] for held in (True, False)}
    per_mb = {held: (b - a) / 32 for held, (a, b) in steps.items()}
    assert per_mb[True] >= busiest
    # where the sender does not wait, the hop is only its receiver's latency (the 1F1B
    # loop's round trip still pays it, so the two differ by less than the held sends)
    assert per_mb[False] < per_mb[True]
    for m in (8, 32, 64):
        extra = _step(tables, True, m) - _step(tables, False, m)
        assert 0 < extra <= 2 * hop * m  # at most both sends of every micro-batch


def test_one_micro_batch_costs_the_same_either_way(tables):
    # nothing waits behind a send when there is no next micro-batch: the hop is paid once
    # on the path either way (held by the sender, or as the receiver's latency), never twice
    # (to the pipeline timer's rounding of the stage times, 4 significant digits)
    assert _step(tables, True, 1) == pytest.approx(_step(tables, False, 1), rel=1e-4)


def test_interleaved_schedules_are_priced_as_before(tables):
    # Megatron overlaps an interleaved schedule's sends (overlap_p2p_comm)
    cfg = replace(CONFIG, schedule="interleaved_1f1b", virtual_stages=2)
    assert _step(tables, True, 8, cfg) == _step(tables, False, 8, cfg)


def test_the_stacks_that_hold_their_sends():
    names = ("megatron-lm", "megatron-core", "deepspeed", "torchtitan", "autopar")
    held = {name: autopar.load_stack(name).options.pipeline_blocking_sends for name in names}
    assert held == {"megatron-lm": True, "megatron-core": True, "deepspeed": True,
                    "torchtitan": False, "autopar": False}  # fmt: skip
