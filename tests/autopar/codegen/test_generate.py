"""Plans record their model factory; plan.save writes plan.json + a train.py that torchrun runs.

The end-to-end tests plan a tiny GPT with evaluate (TP2+SP; PP2 with 1F1B), save it, run the
generated program with `torchrun --nproc-per-node=2 ... --steps 3` and compare its printed
losses and gradient norms with the single-process reference.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.codegen import generate, program_text
from autopar.models import zoo
from autopar.models.source import ZOO_FACTORY, check_fingerprint, model_fingerprint
from autopar.plan import ModelSource, Plan
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run

REPO = Path(__file__).resolve().parents[3]
CONFIG = autopar.ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=2)


@pytest.fixture(scope="module")
def plan() -> Plan:
    model = zoo.build("gpt-tiny")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    inputs = zoo.example_inputs("gpt-tiny", model)
    return autopar.evaluate(model, cluster, CONFIG, inputs, global_batch_size=4, precision="fp32")


def test_plan_records_the_zoo_factory_and_fingerprints(plan):
    source = plan.model_source
    assert source == ModelSource(
        ZOO_FACTORY, {"name": "gpt-tiny", "seed": 0}, model_fingerprint(zoo.build("gpt-tiny"))
    )
    assert len(plan.cluster_fingerprint) == 16
    assert Plan.from_json(plan.to_json()) == plan
    assert "model from  autopar.models.zoo:build(name='gpt-tiny', seed=0)" in plan.summary()


def test_program_is_deterministic_python_showing_the_plan(plan, tmp_path):
    text = program_text(plan)
    assert text == program_text(plan)
    ast.parse(text)
    assert "'blocks.0.attn.qkv': 'colwise',  # fwd: none" in text
    assert "'blocks.1.mlp.proj': 'rowwise_to_seq',  # fwd: reduce-scatter" in text
    assert "--rdzv-backend=c10d" in text and "torchrun --nproc-per-node=2" in text
    path = plan.save(tmp_path)
    assert path.read_text() == plan.to_json()
    assert (tmp_path / "train.py").read_text() == text


def test_user_factory_is_recorded_and_a_model_without_one_saves_json_only(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8))
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=1)
    x = torch.zeros(1, 8)
    bare = autopar.evaluate(model, cluster, autopar.ParallelConfig(), (x,), global_batch_size=2)
    assert bare.model_source is None
    bare.save(tmp_path)
    assert not (tmp_path / "train.py").exists()
    with pytest.raises(ValueError, match="records no model factory"):
        generate(bare, tmp_path)
    named = autopar.evaluate(
        model,
        cluster,
        autopar.ParallelConfig(),
        (x,),
        global_batch_size=2,
        model_factory=("mypackage.models:make", {"width": 8, "dims": (1, 2)}),
    )
    assert named.model_source.kwargs == {"width": 8, "dims": [1, 2]}
    assert Plan.from_json(named.to_json()) == named


def test_program_refuses_another_model():
    with pytest.raises(ValueError, match="fingerprint"):
        check_fingerprint(
            zoo.build("gpt-tiny", num_layers=3), model_fingerprint(zoo.build("gpt-tiny"))
        )


@pytest.fixture(scope="module")
def pp_plan() -> Plan:
    kwargs = {"name": "gpt-tiny", "num_layers": 4}
    model = zoo.build(**kwargs)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    return autopar.evaluate(
        model,
        cluster,
        autopar.ParallelConfig(pp=2, schedule="1f1b"),
        zoo.example_inputs("gpt-tiny", model),
        global_batch_size=4,
        precision="fp32",
        model_factory=(ZOO_FACTORY, kwargs),
    )


def test_pipeline_program_shows_schedule_and_stage_boundaries(pp_plan):
    text = program_text(pp_plan)
    ast.parse(text)
    assert "schedule 1f1b\n# (torch Schedule1F1B), 4 micro-batches per step" in text
    assert "#   chunk 0 blocks 0-1 on pp 0\n#   chunk 1 blocks 2-3 on pp 1" in text
    assert "    ['blocks.2', 'blocks.3', 'ln_f', 'lm_head'],\n]" in text
    assert "stage_layers=STAGE_LAYERS" in text


@pytest.mark.multiprocess
@pytest.mark.slow
def test_saved_pipeline_program_runs_under_torchrun_and_matches_the_reference(pp_plan, tmp_path):
    _run_and_compare(pp_plan, tmp_path, {"name": "gpt-tiny", "num_layers": 4})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_saved_program_runs_under_torchrun_and_matches_the_reference(plan, tmp_path):
    done = _run_and_compare(plan, tmp_path, {"name": "gpt-tiny"})
    assert "(plan " in done.stdout and "rank 1 memory MiB" in done.stdout


def _run_and_compare(plan: Plan, tmp_path: Path, kwargs: dict) -> subprocess.CompletedProcess:
    plan.save(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--standalone", str(tmp_path / "train.py"), "--steps", "3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [
        (float(a), float(b))
        for a, b in re.findall(r"^step \d+/3  loss (\S+)  grad_norm (\S+)", done.stdout, re.M)
    ]
    task = task_from_source(ZOO_FACTORY, kwargs, global_batch_size=4)
    want = [(r.loss, r.grad_norm) for r in reference_run(task, 4, TrainOptions(steps=3))]
    assert len(got) == 3, done.stdout
    for (gl, gn), (wl, wn) in zip(got, want, strict=True):
        assert gl == pytest.approx(wl, rel=1e-5) and gn == pytest.approx(wn, rel=1e-5)
    return done


def test_program_names_the_blocks_of_per_layer_recompute(pp_plan):
    full_1 = replace(pp_plan, config=replace(pp_plan.config, recompute="full", recompute_layers=1))
    text = program_text(full_1)
    ast.parse(text)
    assert "recompute='full', sequence_parallel=False, recompute_layers=1)" in text
    assert (
        "#   only the first 1 blocks of each of the 2 model chunks:\n"
        "#   chunk 0: recomputed blocks.0; kept blocks.1\n"
        "#   chunk 1: recomputed blocks.2; kept blocks.3"
    ) in text
    assert "recompute=full:1" in text  # the config text in the docstring
    assert "recompute_layers" not in program_text(pp_plan)  # unset: the program as before
