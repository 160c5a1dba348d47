"""Elastic re-plan (`autopar.replan`, `autopar replan`): same model on another cluster size,
resuming from the old plan's checkpoint.

The end-to-end test trains gpt-tiny for 2 steps on 4 ranks under DP2xTP2 (the generated
train.py under torchrun, checkpoint at step 2), re-plans it for 2 devices with the CLI
(FSDP2, ZeRO-3), and runs the new train.py on 2 ranks with the same checkpoint directory: it
resumes at step 3 (DCP reshards TP shards into FSDP shards), and steps 3-4 match the
uninterrupted single-process reference within 1e-5 relative, as steps 1-2 of the 4-rank run do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar.cli import main as cli_main
from autopar.models import zoo
from autopar.models.source import ZOO_FACTORY
from autopar.plan import Plan
from autopar.plan.rebuild import ReplanError
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run

REPO = Path(__file__).resolve().parents[3]
BATCH = 4


@pytest.fixture(scope="module")
def plan4() -> Plan:
    model = zoo.build("gpt-tiny")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    config = autopar.ParallelConfig(dp=2, tp=2, micro_batch_size=1)
    inputs = zoo.example_inputs("gpt-tiny", model)
    return autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=BATCH, precision="fp32"
    )


def test_replan_keeps_model_batch_and_precision(plan4):
    small = autopar.replan(plan4, num_devices=2)
    assert small.world_size == 2 and small.config.world_size == 2
    assert small.model_source == plan4.model_source
    assert (small.global_batch_size, small.precision, small.seq_len) == (
        BATCH,
        "fp32",
        plan4.seq_len,
    )
    assert "re-planned from dp=2 fsdp=1 cp=1 tp=2" in small.notes[-1]
    fixed = autopar.replan(plan4, num_devices=2, config=autopar.ParallelConfig(tp=2))
    assert fixed.config == autopar.ParallelConfig(tp=2)
    bigger = autopar.replan(plan4, num_nodes=2)  # the plan's 4 devices per node, twice
    assert bigger.world_size == 8 and bigger.num_nodes == 2


def test_replan_refusals(plan4):
    with pytest.raises(ReplanError, match="needs num_nodes or num_devices"):
        autopar.replan(plan4)
    with pytest.raises(ReplanError, match="num_devices=3 is not a multiple of num_nodes=2"):
        autopar.replan(plan4, num_nodes=2, num_devices=3)
    with pytest.raises(ReplanError, match="records no model factory"):
        autopar.replan(replace(plan4, model_source=None), num_devices=2)
    changed = replace(plan4.model_source, fingerprint="0123456789abcdef")
    with pytest.raises(ReplanError, match="plan was made for fingerprint 0123456789abcdef"):
        autopar.replan(replace(plan4, model_source=changed), num_devices=2)
    with pytest.raises(autopar.ConfigError, match="tp=4"):
        autopar.replan(plan4, num_devices=2, config=autopar.ParallelConfig(tp=4))


def _torchrun(n: int, program: Path, ckpt: Path, steps: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--standalone"]
    cmd += [str(program), "--steps", str(steps), "--checkpoint-dir", str(ckpt)]
    cmd += ["--checkpoint-every", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_four_ranks_to_two_resumes_with_loss_continuity(plan4, tmp_path, capsys):
    plan4.save(tmp_path / "four")
    ckpt = tmp_path / "ckpt"
    _torchrun(4, tmp_path / "four" / "train.py", ckpt, steps=2)
    args = [str(tmp_path / "four" / "plan.json"), "--num-devices", "2"]
    args += ["--config", "fsdp=2,zero=3,mbs=1", "-o", str(tmp_path / "two")]
    assert cli_main(["replan", *args]) == 0
    assert "wrote" in capsys.readouterr().out
    two = Plan.from_json((tmp_path / "two" / "plan.json").read_text())
    assert two.world_size == 2 and two.config.fsdp == 2
    out = _torchrun(2, tmp_path / "two" / "train.py", ckpt, steps=4)
    assert "resumed from" in out and "(step 2, 8 samples seen, saved under dp=2" in out

    log = [json.loads(line) for line in (ckpt / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]  # 1-2 on four ranks, 3-4 on two
    task = task_from_source(ZOO_FACTORY, {"name": "gpt-tiny"}, global_batch_size=BATCH)
    want = [r.loss for r in reference_run(task, BATCH, TrainOptions(steps=4))]
    got = [float.fromhex(r["loss"]) for r in log]
    errors = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]
    print("losses", got, "reference", want, "relative errors", errors)
    assert max(errors) <= 1e-5, (got, want)
