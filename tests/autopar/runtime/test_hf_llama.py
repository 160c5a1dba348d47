"""Hugging Face Llama (tiny config) under the runtime: TP2, TP2+SP and DP2xTP2 match the single
process (its decoder layers call attention with keyword arguments, which the TP hooks take),
and parallelize -> save -> torchrun on 4 ranks trains it: the loss falls over 20 steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import max_rel_error, run_ranks

import autopar
from autopar.config import ParallelConfig as C
from autopar.models import hf
from autopar.models.source import HF_FACTORY
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run, train

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
PRESET, SEQ, BATCH = "llama-tiny-hf", 32, 4
OPTIONS = TrainOptions(steps=3, log=False)


def _task():
    return task_from_source(HF_FACTORY, {"name": PRESET}, global_batch_size=BATCH, seq_len=SEQ)


def _run(configs: list[C]) -> list[list[tuple[float, float]]]:
    return [
        [(r.loss, r.grad_norm) for r in train(_task(), cfg, BATCH, options=OPTIONS)]
        for cfg in configs
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hf_llama_tensor_parallel_matches_single_process():
    want = [(r.loss, r.grad_norm) for r in reference_run(_task(), BATCH, OPTIONS)]
    two = [C(tp=2), C(tp=2, sequence_parallel=True)]
    four = [C(dp=2, tp=2)]
    for configs, world in ((two, 2), (four, 4)):
        per_rank = run_ranks(world, _run, configs)
        for i, cfg in enumerate(configs):
            err = max(max_rel_error(rank[i], want) for rank in per_rank)
            assert err <= 1e-5, f"HF Llama {cfg.as_text()}: relative error {err:.1e}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hf_llama_parallelize_save_torchrun_loss_falls(tmp_path):
    model = hf.build(PRESET)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    plan = autopar.parallelize(model, cluster, global_batch_size=8, precision="fp32")
    plan.save(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone"]
    cmd += [str(tmp_path / "train.py"), "--steps", "20", "--lr", "3e-3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/20  loss (\S+)", done.stdout, re.M)]
    assert len(losses) == 20, done.stdout
    print(plan.config.as_text(), losses[0], losses[-1])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
