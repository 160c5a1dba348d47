"""One collective timeout for a run's every group: the default group's, which torch does not
pass on to the groups made after it (a DeviceMesh's dimensions, the expert and pipeline tie
groups), and a collective whose peer never comes fails after it."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from autopar.config import ParallelConfig as C
from autopar.runtime.mesh import build_mesh, collective_timeout

SHORT = datetime.timedelta(seconds=3)
TORCH_GLOO_DEFAULT = datetime.timedelta(minutes=30)  # what `new_group` gives a group


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _groups_timeouts() -> dict[str, datetime.timedelta]:
    from autopar.runtime.parallelize import _expert_groups
    from autopar.runtime.pipeline import tie_group_of
    from autopar.runtime.stages import ChunkLayout

    out = {
        "default": collective_timeout(),
        "plain new_group": _timeout(dist.new_group([0, 1, 2, 3])),
    }
    # 4 ranks, so that each group is a proper subgroup: DeviceMesh hands a dimension that
    # spans the world the default group itself
    mesh = build_mesh(C(dp=2, tp=2), "cpu")
    out |= {axis: _timeout(mesh.group(axis)) for axis in ("dp", "tp")}
    cfg = C(dp=2, tp=2, ep=2)
    out["ep"] = _timeout(_expert_groups(build_mesh(cfg, "cpu"), cfg).ep)
    pp = build_mesh(C(pp=2, tp=2), "cpu")
    out["tie"] = _timeout(tie_group_of(pp, ChunkLayout(2, ((0, 1), (1, 2)))))
    return out


@pytest.mark.multiprocess
def test_every_group_of_the_run_takes_the_default_groups_timeout():
    got = run_ranks(4, _groups_timeouts, collective_timeout=SHORT)
    for timeouts in got:
        # torch's own default for a group made after the default one: the case this fixes
        assert timeouts.pop("plain new_group") == TORCH_GLOO_DEFAULT
        assert timeouts == dict.fromkeys(timeouts, SHORT)


def _rank1_skips_a_tensor_parallel_all_reduce() -> str:
    mesh = build_mesh(C(dp=2, tp=2), "cpu")  # tp groups {0, 1} and {2, 3}
    if dist.get_rank() == 1:  # alive, in no collective: rank 0's waits out its timeout
        time.sleep(20)
        return ""
    try:
        dist.all_reduce(torch.ones(1), group=mesh.group("tp"))
    except RuntimeError as error:
        return str(error)
    return "the all-reduce returned"


@pytest.mark.multiprocess
def test_a_collective_whose_peer_never_comes_fails_after_the_runs_timeout():
    # with torch's 30 minutes the all-reduce would wait until rank 1 left after 20 s and
    # then fail on a closed connection, not on its timeout
    said = run_ranks(4, _rank1_skips_a_tensor_parallel_all_reduce, collective_timeout=SHORT)
    assert "Timed out" in said[0] and "3000ms" in said[0], said[0]
    assert said[2:] == ["the all-reduce returned"] * 2  # the other tp group's peers both came
