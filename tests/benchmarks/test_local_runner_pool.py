"""local_runner's pool gives each program the fresh process group torchrun would.

A DeviceMesh makes gloo groups that live as long as the default group; each keeps threads and
sockets. When the pool ran every program on one default group, 30 programs in, a step measured
20% slower than on a fresh pool (benchmarks/local_validation.py's later configs). The pool
now makes a default group per program and destroys it, with every group made from it, after
the program; these programs report their rank's thread count in place of a step time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import local_runner  # noqa: E402

PROGRAM = """
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.mesh import init_distributed


def main():
    init_distributed("cpu")
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(1, world), mesh_dim_names=("a", "b"))
    dist.all_reduce(torch.ones(4), group=mesh.get_group("b"))
    threads = len(os.listdir("/proc/self/task"))
    print(f"step 1/1  loss 0.0  time {threads} s")
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_programs_in_one_pool_do_not_inherit_each_others_groups(tmp_path):
    programs = []
    for i in range(5):
        directory = tmp_path / f"p{i}"
        directory.mkdir()
        (directory / "train.py").write_text(PROGRAM)
        programs.append(local_runner.Program(f"p{i}", str(directory)))
    got = local_runner.measure(2, programs, steps=1, threads=1)
    threads = [got[p.key].step_times_s[0] for p in programs]
    assert all(got[p.key].ok for p in programs), got
    # a leaked mesh adds its groups' threads to every later program's count
    assert threads[-1] <= threads[1], threads
