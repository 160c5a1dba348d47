"""The compute profile's timing loop: a call of seconds is not repeated in batches, and no
larger size of its op is timed (a CPU without bf16 units spent minutes on them)."""

from __future__ import annotations

import time

import torch

from autopar.profiler import compute
from autopar.profiler.compute import ComputePlan, measure_compute, time_call


def test_one_stalled_first_call_does_not_shrink_the_batches():
    """A busy machine preempting the first call made every batch one call long, each as
    stalled; the batch is sized from the best of three calls."""
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.05)

    time_call(fn, torch.device("cpu"), target_s=0.01, repeats=2)
    assert len(calls) > 3 + 2 * 10  # batches of many calls, not of one


def _counting():
    calls = []
    return calls, lambda: calls.append(1)


def test_a_short_call_is_timed_in_batches_a_slow_one_once_more():
    calls, fn = _counting()
    time_call(fn, torch.device("cpu"), target_s=0.001, repeats=3)
    assert len(calls) >= 3 + 3  # three single calls, then three batches of at least one
    calls, fn = _counting()
    # the same call counted slow: the first call and one more
    saved, compute.SLOW_CALL_S = compute.SLOW_CALL_S, 0.0
    try:
        time_call(fn, torch.device("cpu"), target_s=0.001, repeats=3)
    finally:
        compute.SLOW_CALL_S = saved
    assert len(calls) == 2


def test_matmul_sizes_stop_after_a_slow_call(monkeypatch):
    plan = ComputePlan((16, 32, 64), (), (), "fp32", 0.001, 2)
    said = []
    full = measure_compute(torch.device("cpu"), plan, said.append)
    sizes = [(m.dtype, m.shape) for m in full if m.op == "matmul"]
    assert len(sizes) == 6  # fp32 and bf16 at three sizes
    monkeypatch.setattr(compute, "SLOW_CALL_S", 0.0)
    said.clear()
    cut = measure_compute(torch.device("cpu"), plan, said.append)
    sizes = [(m.dtype, m.shape) for m in cut if m.op == "matmul"]
    assert sizes == [("fp32", "16x16x16"), ("bf16", "16x16x16")]
    assert any("larger skipped" in line for line in said), said
