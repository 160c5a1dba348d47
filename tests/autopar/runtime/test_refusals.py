"""Run-time refusals of a generated program: a plan.json of another model beside train.py,
and a launch on another number of ranks than the plan's. (A checkpoint of another model or
global batch is refused in test_checkpoint.py; the mesh's own world-size check in
test_numerics_small.py.)
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.models import zoo
from autopar.plan import Plan

REPO = Path(__file__).resolve().parents[3]
CONFIG = autopar.ParallelConfig(dp=2, tp=2, micro_batch_size=1)


def _plan(name: str) -> Plan:
    model = zoo.build(name)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    inputs = zoo.example_inputs(name, model)
    return autopar.evaluate(model, cluster, CONFIG, inputs, global_batch_size=4, precision="fp32")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_program_refuses_a_plan_json_of_another_model(tmp_path):
    gpt, llama = _plan("gpt-tiny"), _plan("llama-tiny")
    gpt.save(tmp_path)
    (tmp_path / "plan.json").write_text(llama.to_json())  # same config, another model
    with pytest.raises(SystemExit) as refused:  # at load, before torch.distributed starts
        runpy.run_path(str(tmp_path / "train.py"), run_name="train")
    assert "plan.json is not the plan this train.py was generated from" in str(refused.value)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_program_refuses_another_world_size(tmp_path):
    _plan("gpt-tiny").save(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += [str(tmp_path / "train.py"), "--steps", "1"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert "the plan needs 4 ranks (pp=1 x dp=2 x fsdp=1 x cp=1 x tp=2) but torchrun started 2" in (
        text
    ), text[-3000:]
