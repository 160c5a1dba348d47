"""Fault injection: a rank SIGKILLed mid-run, torchrun restarts the group, the run resumes.

A DP2xTP2 plan of gpt-tiny (4 CPU ranks) is saved with its generated train.py and run twice
under `torchrun --nproc-per-node=4 --max-restarts=3`, checkpointing every 2 steps:
- uninterrupted, 7 steps (asynchronous checkpoints);
- with a fault: rank 1 kills itself with SIGKILL when it fetches step 6's batch, once (a marker
  file says it has), after rank 0 has logged step 5. torchrun stops the group and starts it
  again; the next attempt resumes from the step-4 checkpoint (the newest complete one),
  recomputes step 5 and runs to step 7.
torchrun may restart a group more than once: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE rank 0 binds
the port the agent picked, and on a busy machine another test can take it first (EADDRINUSE at
init). Such an attempt logs no step, so the test reads the attempts that logged steps.
From the resume point on, every step's loss equals the uninterrupted run's bitwise (compared
as float.hex, from the checkpoint directory's log.jsonl), and no step at or before the
checkpoint is computed again.

The kill lives in a test-only data hook (`--data`), which serves the program's own synthetic
batches; the program and its defaults know nothing of it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import autopar
from autopar.models import zoo

REPO = Path(__file__).resolve().parents[3]
CONFIG = autopar.ParallelConfig(dp=2, tp=2, micro_batch_size=1)
BATCH, STEPS, EVERY, KILL_STEP, KILL_RANK = 4, 7, 2, 6, 1

HOOK = f"""
import os
import signal
import time

from autopar.models.source import ZOO_FACTORY
from autopar.runtime.task import task_from_source

TASK = task_from_source(ZOO_FACTORY, {{"name": "gpt-tiny", "seed": 0}}, global_batch_size={BATCH})


def batch(step, start, stop):
    # step is 0-based; kill once: the marker says a kill already happened
    kill = int(os.environ.get("FAULT_KILL_STEP", "0"))
    marker = os.environ.get("FAULT_MARKER", "")
    if step + 1 == kill and int(os.environ["RANK"]) == {KILL_RANK} and not os.path.exists(marker):
        # rank 0 logs the step before this one after its last collective, so this rank can get
        # here first; on a loaded machine torchrun would stop rank 0 before it writes the line.
        # Wait for it (bounded), so the test reads which steps ran, not which rank was quicker
        log = os.environ["FAULT_LOG"]
        for _ in range(1200):
            if os.path.exists(log) and f'"step": {{kill - 1}},' in open(log).read():
                break
            time.sleep(0.1)
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return TASK.batch(step, start, stop)
"""


def _torchrun(program: Path, ckpt: Path, hooks: Path, extra: list[str], env: dict) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4"]
    cmd += ["--standalone", "--max-restarts=3", "--monitor-interval=0.2", str(program)]
    cmd += ["--steps", str(STEPS), "--data", "fault_hook:batch", "--checkpoint-dir", str(ckpt)]
    cmd += ["--checkpoint-every", str(EVERY), *extra]
    path = os.pathsep.join([str(REPO), str(hooks)])
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    # a restarted group must not share the agent's rendezvous store with the first attempt's
    # stale gloo addresses (pytorch/pytorch#135712); the generated program's docstring says so
    full_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


def _log(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "log.jsonl").read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_rank_resumes_from_last_checkpoint_bitwise(tmp_path):
    model = zoo.build("gpt-tiny")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    inputs = zoo.example_inputs("gpt-tiny", model)
    plan = autopar.evaluate(
        model, cluster, CONFIG, inputs, global_batch_size=BATCH, precision="fp32"
    )
    plan.save(tmp_path / "prog")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "fault_hook.py").write_text(textwrap.dedent(HOOK))
    program = tmp_path / "prog" / "train.py"

    straight_dir = tmp_path / "straight"
    _torchrun(program, straight_dir, hooks, ["--async-checkpoint"], {})
    straight = {r["step"]: r["loss"] for r in _log(straight_dir)}
    assert sorted(straight) == list(range(1, STEPS + 1))

    fault_dir = tmp_path / "fault"
    env = {"FAULT_KILL_STEP": str(KILL_STEP), "FAULT_MARKER": str(tmp_path / "killed")}
    env["FAULT_LOG"] = str(fault_dir / "log.jsonl")
    out = _torchrun(program, fault_dir, hooks, [], env)
    assert re.search(r"Signals\.SIGKILL|signal 9|exitcode\s*:\s*-9", out), out[-3000:]
    log = _log(fault_dir)
    attempts = sorted({r["attempt"] for r in log})
    assert len(attempts) == 2, attempts  # the killed attempt and the one that resumed
    first = [r["step"] for r in log if r["attempt"] == attempts[0]]
    second = [r["step"] for r in log if r["attempt"] == attempts[1]]
    last_ckpt = (KILL_STEP - 1) // EVERY * EVERY  # 4: the newest checkpoint before the kill
    assert first == list(range(1, KILL_STEP))  # steps 1-5 ran, the kill came in step 6
    assert second == list(range(last_ckpt + 1, STEPS + 1))  # resumed at 5: nothing before
    assert f"resumed from {fault_dir / f'step-{last_ckpt:08d}'}" in out
    for r in log:
        assert r["loss"] == straight[r["step"]], (r, straight[r["step"]])
    kept = sorted(p.name for p in fault_dir.glob("step-*"))
    assert kept == ["step-00000004", "step-00000006"]
    assert not list(fault_dir.glob(".partial-*"))
    print("losses (hex):", [(r["step"], r["attempt"], r["loss"]) for r in log])
