"""The generated program's own options and hooks: a bad one stops every rank before a step
with one line from rank 0 and exit status 1, no traceback (issue 45).

A gpt-tiny DP2 program, its 2 ranks started as torchrun starts them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT in each process's environment; torchrun itself prints its own summary of a
failed child, which is not the program's), once per case: a learning rate NaN or negative, a
loss that is not a function, names a missing module, returns a vector, an int or a value
without gradient, or turns NaN (the run stops at the step, naming where to resume); a data
hook returning None or float token ids; a checkpoint directory or metrics log that cannot be
written; a --hf-dataset file that does not parse or a Hub name offline, a --tokenizer that does
not load; a collective timeout of 0; a checkpoint directory holding another model's
checkpoint; a DiLoCo or fault-tolerant replica group without its lighthouse, or outside the
groups. A NaN step is skipped where --skip-nonfinite allows it. `--traceback` shows the
traceback instead. What is refused before the process group starts runs on rank 0 alone: that
it stops without waiting for rank 1 is part of what is shown.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.runtime.mesh import free_port

HOOKS = """
import torch
def vector(out, target): return out.float().sum(-1).flatten()
def integer(out, target): return 3
def nograd(out, target): return out.detach().float().mean()
def nan(out, target): return out.float().mean() * float("nan")
CALLS = [0]
def nan_once(out, target):  # step 1's first micro-batch only
    CALLS[0] += 1
    return out.float().mean() * (float("nan") if CALLS[0] == 1 else 1.0)
def none(step, start, stop): return None
def floats(step, start, stop):
    x = torch.rand(stop - start, 16)
    return (x,), x.long()
"""
CASES = {
    "lr nan": (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    "lr negative": (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    "loss not a function": (["--loss", "os:sep"], "--loss os:sep: a str, not a function"),
    "loss module missing": (["--loss", "nomodule:fn"], "cannot import 'nomodule'"),
    "loss a vector": (["--loss", "hooks:vector"], "returned a tensor of shape (32,)"),
    "loss an int": (["--loss", "hooks:integer"], "returned int, not a tensor"),
    "loss without gradient": (["--loss", "hooks:nograd"], "a value without gradient"),
    "loss NaN": (["--loss", "hooks:nan"], "step 1: the loss is nan"),
    "data None": (["--data", "hooks:none"], "must return (inputs, targets), got NoneType"),
    "data float ids": (["--data", "hooks:floats"], "inputs[0] holds torch.float32 values"),
    "checkpoint dir": (["--checkpoint-dir", "/proc/autopar"], "--checkpoint-dir /proc/autopar"),
    "metrics": (["--metrics", "/proc/x/m.jsonl"], "--metrics /proc/x: cannot write there"),
    "skips negative": (["--skip-nonfinite", "-1"], "--skip-nonfinite must be a whole number"),
    "timeout zero": (["--collective-timeout", "0"], "--collective-timeout must be > 0 s, not 0.0"),
    "diloco without lighthouse": (["--diloco-group", "0"], "--diloco-group needs --lighthouse"),
    "ft without lighthouse": (["--ft-group", "0"], "--ft-group needs --lighthouse"),
    "diloco group out of range": (
        ["--diloco-group", "2", "--lighthouse", "http://x:1"],
        "replica_id must be in [0, 2), got 2",
    ),
    "hf-dataset malformed": (
        ["--hf-dataset", "{dir}/broken.jsonl", "--tokenizer", "bytes"],
        "broken.jsonl: cannot be read (DatasetGenerationError",
    ),
    "hf-dataset offline": (
        ["--hf-dataset", "nobody/no-such-dataset", "--tokenizer", "bytes"],
        "--hf-dataset nobody/no-such-dataset: cannot be read",
    ),
    "tokenizer": (
        ["--hf-dataset", "{dir}/good.jsonl", "--tokenizer", "{dir}"],
        "does not load",
    ),
}


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("program")
    model = autopar.models.zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    inputs = autopar.models.zoo.example_inputs("gpt-tiny", model)
    plan = autopar.evaluate(model, cluster, autopar.ParallelConfig(dp=2), inputs,
                            global_batch_size=8)  # fmt: skip
    plan.save(out)
    (out / "hooks.py").write_text(HOOKS)
    (out / "broken.jsonl").write_text('{"text": "fine"}\n{"text": no quotes}\n')
    (out / "good.jsonl").write_text('{"text": "fine"}\n')
    return out / "train.py"


# refused before init_distributed: rank 0 alone shows it (a rank that reached the group's
# rendezvous would wait there for rank 1 until the timeout), at half the processes
BEFORE_INIT = {"lr nan", "lr negative", "loss not a function", "loss module missing",
               "checkpoint dir", "metrics", "skips negative", "diloco without lighthouse",
               "diloco group out of range", "ft without lighthouse", "timeout zero"}  # fmt: skip


def _run(program: Path, args: list[str], ranks: int = 2) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONPATH=str(program.parent), OMP_NUM_THREADS="1",
                   AUTOPAR_CACHE=str(program.parent / "cache"), HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1")  # fmt: skip
        args = [a.format(dir=program.parent) for a in args]
        cmd = [sys.executable, str(program), "--steps", "1", *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300 if ranks > 1 else 120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("label", sorted(CASES))
def test_a_bad_option_or_hook_stops_every_rank_with_one_line(program, label):
    args, fragment = CASES[label]
    ranks = _run(program, args, ranks=1 if label in BEFORE_INIT else 2)
    assert {r.returncode for r in ranks} == {1}, [r.stderr[-2000:] for r in ranks]
    said = [line for line in ranks[0].stderr.splitlines() if line.startswith("train.py:")]
    assert len(said) == 1 and fragment in said[0], ranks[0].stderr[-2000:]
    for r in ranks:
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for r in ranks[1:]:
        assert not any(line.startswith("train.py:") for line in r.stderr.splitlines())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_traceback_on_request(program):
    ranks = _run(program, ["--lr", "nan", "--traceback"])
    assert ranks[0].returncode != 0 and "Traceback" in ranks[0].stderr
    assert "RunError: --lr must be a finite number" in ranks[0].stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_nan_step_is_skipped_where_allowed_and_the_run_goes_on(program, tmp_path):
    metrics = tmp_path / "m.jsonl"
    # with a collective timeout of its own (every group's: test_collective_timeout.py)
    args = ["--loss", "hooks:nan_once", "--skip-nonfinite", "1", "--steps", "3",
            "--collective-timeout", "120"]  # fmt: skip
    ranks = _run(program, [*args, "--metrics", str(metrics)])
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert "step 1 skipped: the loss is nan" in ranks[0].stdout
    assert "0 more skips allowed" in ranks[0].stdout
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps] == [2, 3]  # step 1 took no optimizer step
    assert all(math.isfinite(s["loss"]) for s in steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_of_another_model_stops_every_rank_with_one_line(program, tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _run(program, ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"])
    assert [r.returncode for r in saved] == [0, 0], [r.stderr[-2000:] for r in saved]
    (step,) = ckpt.glob("step-*")
    meta = json.loads((step / "meta.json").read_text())  # as another model's would say
    meta["model_fingerprint"] = "0123456789abcdef"
    (step / "meta.json").write_text(json.dumps(meta))
    ranks = _run(program, ["--checkpoint-dir", str(ckpt), "--steps", "2"])
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-2000:] for r in ranks]
    said = [line for line in ranks[0].stderr.splitlines() if line.startswith("train.py:")]
    assert len(said) == 1 and "holds a model with fingerprint 0123456789abcdef" in said[0]
    assert all("Traceback" not in r.stderr for r in ranks), ranks[0].stderr[-2000:]
