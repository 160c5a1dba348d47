"""A model, loss and data of the user's own (issue 19): an MLP classifier in a package outside
the repository, with its own cross-entropy over 5 classes and its own data hook.

- `parallelize(..., model_factory=, loss_fn=)` records the loss and the directory the package
  imports from; a loss that does not import is refused at planning time.
- The generated train.py runs under torchrun with no PYTHONPATH and from another directory
  (it puts the recorded directory on sys.path), trains with the user's loss on the user's
  data, and its per-step losses equal the single-process run's within 1e-5 relative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run

PACKAGE = {
    "__init__.py": "",
    "models.py": textwrap.dedent(
        """
        import torch
        from torch import nn

        def make(width=32, classes=5, seed=0):
            torch.manual_seed(seed)
            return nn.Sequential(
                nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                nn.Linear(64, classes),
            )

        def xent(outputs, targets):
            return nn.functional.cross_entropy(outputs.float(), targets)

        def batch(step, start, stop):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(8, 32, generator=g)
            y = torch.randint(0, 5, (8,), generator=g)
            return (x[start:stop],), y[start:stop]
        """
    ),
}


@pytest.fixture()
def package(tmp_path, monkeypatch):
    root = tmp_path / "src"
    (root / "myclf").mkdir(parents=True)
    for name, text in PACKAGE.items():
        (root / "myclf" / name).write_text(text)
    monkeypatch.syspath_prepend(str(root))  # importable here, as from the user's own project
    yield root
    for name in [m for m in sys.modules if m == "myclf" or m.startswith("myclf.")]:
        del sys.modules[name]


def _plan(loss: str) -> autopar.Plan:
    from myclf.models import make

    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    return autopar.parallelize(
        make(), cluster, (torch.randn(1, 32),), global_batch_size=8, precision="fp32",
        model_factory=("myclf.models:make", {"width": 32}), loss_fn=loss,
    )  # fmt: skip


def test_the_loss_and_the_import_root_are_recorded_and_a_bad_loss_refused(package):
    plan = _plan("myclf.models:xent")
    assert plan.model_source.loss == "myclf.models:xent"
    assert Path(plan.model_source.import_root) == package.resolve()
    back = autopar.Plan.from_json(plan.to_json())
    assert back.model_source == plan.model_source
    with pytest.raises(ValueError, match="'myclf.models' has no attribute 'nope'"):
        _plan("myclf.models:nope")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_generated_program_trains_the_users_loss_without_pythonpath(package, tmp_path):
    plan = _plan("myclf.models:xent")
    out = tmp_path / "run"
    plan.save(out)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += [str(out / "train.py"), "--steps", "3", "--data", "myclf.models:batch"]
    cmd += ["--precision", "fp32", "--metrics", str(metrics)]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    task = task_from_source(
        "myclf.models:make", {"width": 32}, global_batch_size=8,
        data="myclf.models:batch", loss="myclf.models:xent",
    )  # fmt: skip
    torch.set_num_threads(1)
    ref = [r.loss for r in reference_run(task, 8, TrainOptions(steps=3, log=False))]
    assert len(got) == 3
    for a, b in zip(got, ref, strict=True):
        assert abs(a / b - 1) < 1e-5
