"""`python3 -m autopar demo` (the README's first command): plans Llama 3 8B on 2 DGX H100 nodes,
then plans, saves and runs a tiny Llama on 4 local CPU ranks, printing measured vs predicted."""

from __future__ import annotations

import re

import pytest

from autopar.cli.demo import run_demo


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_plans_the_real_model_then_runs_the_local_program(tmp_path):
    text = run_demo(out_dir=str(tmp_path), local_steps=5)
    assert (tmp_path / "plan.json").exists() and (tmp_path / "local" / "train.py").exists()
    assert "on local_cpu x 4 ranks" in text
    steps = re.findall(
        r"^step (\d+)/5  loss (\S+) .*\(plan \S+ s\).*\(measured/plan\)$", text, re.M
    )
    assert [int(s) for s, _ in steps] == [1, 2, 3, 4, 5]
    assert float(steps[-1][1]) < float(steps[0][1])
    assert len(re.findall(r"^\[autopar\] rank \d memory MiB", text, re.M)) == 4
