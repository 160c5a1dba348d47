"""Real data, learning-rate schedule and metrics of the generated program
(autopar.runtime.data, TrainOptions.lr_at, autopar.runtime.metrics): the token file is read by
step and rank, so a 4-rank run resumed from a mid-epoch checkpoint reads what an uninterrupted
run reads and trains to the same losses bit for bit; the metrics log has a line per step
beside the plan's prediction."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import autopar
from autopar.models import hf
from autopar.runtime.data import TokenFile, write_tokens
from autopar.runtime.trainer import TrainOptions

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "data" / "tokens" / "autopar-docs.bin"


def test_rows_of_a_step_are_consecutive_windows_and_ranks_read_their_share(tmp_path):
    ids = np.arange(1000) % 97
    data = TokenFile(write_tokens(tmp_path / "t.bin", ids), seq_len=10, global_batch_size=4)
    assert data.num_windows == 100 and data.steps_per_epoch == 25
    (whole,), targets = data(3, 0, 4)  # step 3: windows 12..15
    assert whole.tolist()[0] == (ids[120:130]).tolist() and (targets == whole).all()
    (half,), _ = data(3, 2, 4)  # a rank's rows [2, 4)
    assert half.tolist() == whole[2:].tolist()
    (wrapped,), _ = data(25, 0, 1)  # the next epoch starts over
    assert wrapped.tolist() == whole.new_tensor(ids[:10]).view(1, -1).tolist()


def test_npy_and_bin_files_read_the_same_and_bad_files_are_refused(tmp_path):
    ids = np.arange(300, dtype=np.uint32)
    npy = TokenFile(write_tokens(tmp_path / "t.npy", ids, "uint32"), 30, 2)
    raw = TokenFile(write_tokens(tmp_path / "t.bin", ids, "uint32"), 30, 2, dtype="uint32")
    assert (npy(1, 0, 2)[1] == raw(1, 0, 2)[1]).all()
    with pytest.raises(ValueError, match="fewer than one sequence of 512"):
        TokenFile(tmp_path / "t.npy", 512, 2)
    np.save(tmp_path / "m.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="one flat array of integer ids, got shape"):
        TokenFile(tmp_path / "m.npy", 2, 2)
    with pytest.raises(FileNotFoundError, match="no such token file"):
        TokenFile(tmp_path / "missing.bin", 2, 2)


def test_learning_rate_warms_up_then_decays_to_its_floor():
    opts = TrainOptions(steps=110, lr=1e-3, warmup_steps=10, lr_schedule="cosine")
    assert opts.lr_at(0) == pytest.approx(1e-4) and opts.lr_at(9) == pytest.approx(1e-3)
    assert opts.lr_at(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway down the cosine
    assert opts.lr_at(110) == pytest.approx(1e-4)
    lrs = [opts.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert TrainOptions(lr=2e-3).lr_at(50) == 2e-3


def _torchrun(train: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone"]
    done = subprocess.run(
        [*cmd, str(train), *args], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _losses(log: Path) -> dict[int, str]:
    return {line["step"]: line["loss"] for line in map(json.loads, log.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_ranks_train_on_the_shipped_file_and_resume_at_the_same_position(tmp_path):
    model = hf.build("llama-tiny-hf")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    config = autopar.ParallelConfig(dp=2, fsdp=2, zero_stage=1, micro_batch_size=2)
    import torch

    inputs = (torch.randint(0, 128, (1, 256), device="meta"),)
    plan = autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=8, precision="fp32",
        model_factory=("autopar.models.hf:build", {"name": "llama-tiny-hf"}),
    )  # fmt: skip
    plan.save(tmp_path / "run")
    train = tmp_path / "run" / "train.py"
    data = ["--tokens", str(SHIPPED), "--lr", "3e-3", "--warmup-steps", "2"]
    data += ["--lr-schedule", "cosine"]
    assert TokenFile(SHIPPED, plan.seq_len, 8).steps_per_epoch > 6  # step 3 is mid-epoch
    whole = tmp_path / "whole"
    _torchrun(train, *data, "--steps", "6", "--checkpoint-dir", str(whole),
              "--checkpoint-every", "3", "--metrics", str(tmp_path / "metrics.jsonl"))  # fmt: skip
    # the same run stopped after step 3: its directory without the later checkpoint
    parts = tmp_path / "parts"
    shutil.copytree(whole, parts)
    later = [p for p in parts.iterdir() if p.name.startswith("step-") and p.name != "step-00000003"]
    assert (parts / "step-00000003").is_dir() and later
    for path in later:
        shutil.rmtree(path)
    _torchrun(train, *data, "--steps", "6", "--checkpoint-dir", str(parts),
              "--checkpoint-every", "3")  # fmt: skip
    want, got = _losses(whole / "log.jsonl"), _losses(parts / "log.jsonl")
    assert len((parts / "log.jsonl").read_text().splitlines()) == 6 + 3  # resumed after 3
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # exact (hex floats)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert [m["loss"] for m in metrics] == [float.fromhex(want[s]) for s in range(1, 7)]
    first, last = metrics[0], metrics[-1]
    assert last["loss"] < first["loss"] < math.log(128) + 0.5  # real text, learnt
    assert first["lr"] == pytest.approx(1.5e-3)  # warmup: step 1 of 2
    assert first["predicted_step_time_s"] == pytest.approx(plan.step_time_s)
    tokens = plan.global_batch_size * plan.seq_len
    assert last["tokens_per_s"] == pytest.approx(tokens / last["step_time_s"])
    assert last["mfu"] == pytest.approx(plan.mfu * plan.step_time_s / last["step_time_s"])
    assert last["peak_memory_bytes"] > 0 and last["predicted_peak_memory_bytes"] > 0
