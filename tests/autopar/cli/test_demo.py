"""`python3 -m autopar demo` (the README's first command): plans Llama 3 8B on 2 DGX H100 nodes,
then plans, saves and runs a tiny Llama on 4 local CPU ranks, printing measured vs predicted."""

from __future__ import annotations

import re

import pytest

from autopar.cli.demo import _local_groups, run_demo


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


@pytest.mark.multiprocess
def test_demo_runs_the_local_plan_as_fault_tolerant_replica_groups(tmp_path):
    """`autopar demo --local-groups 2`: the lighthouse started here, one torchrun per group;
    both groups take every step with the same gradient (its norm, averaged over the groups)
    and end with the same parameters (each rank's digest)."""
    text = "\n".join(_local_groups(tmp_path, 2, 3, 2))
    norms = {
        g: re.findall(rf"^\[group {g}\] step (\d)/3  loss \S+  grad_norm (\S+)", text, re.M)
        for g in (0, 1)
    }
    assert [s for s, _ in norms[0]] == ["1", "2", "3"] and norms[0] == norms[1], text
    digests = re.findall(r"replica group (\d), rank 0: parameters (\w+) after step 3", text)
    assert sorted(g for g, _ in digests) == ["0", "1"] and len({d for _, d in digests}) == 1
    assert "each rank's parameters are the same in every group" in text
    with pytest.raises(ValueError, match="--local-groups 3 must divide --local-ranks 4"):
        run_demo(local_ranks=4, local_groups=3)
