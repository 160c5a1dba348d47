"""The multi-rank harness fails a spawn whose ranks hang, saying where each stood."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks


def _rank1_waits_for_a_send_rank0_never_makes() -> int:
    if dist.get_rank() == 0:
        time.sleep(600)
    else:  # gloo would wait out its collective timeout (minutes) here
        dist.recv(torch.zeros(1), src=0)
    return dist.get_rank()


@pytest.mark.multiprocess
def test_ranks_past_the_deadline_fail_the_test_with_their_stacks():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(2, _rank1_waits_for_a_send_rank0_never_makes, deadline_s=5)
    said = str(failed.value)
    assert "ranks [0, 1] still running after 5 s" in said
    rank0, rank1 = said.split("rank 1:\n")
    # rank 0 in its sleep (a C call: the stack ends in the function), rank 1 in gloo's recv
    assert "in _rank1_waits_for_a_send_rank0_never_makes" in rank0 and "in recv" not in rank0
    assert "in recv" in rank1 and "in _rank1_waits_for_a_send_rank0_never_makes" in rank1
    # the ranks are gone: the spawn returned well before rank 0's sleep ends
    assert time.monotonic() - start < 300
