"""The program does what the plan says: collectives, state bytes and activations of one step.

For TP2, TP2+SP, FSDP (ZeRO-3) and DP2xTP2 on the tiny GPT and Llama, one training step on gloo
ranks issues exactly the collectives `Plan.communication` predicts (kind, calls, bytes per
call; the loss-parallel reductions by count, their bytes being an upper bound), holds exactly
the planned parameter, gradient and optimizer-state bytes per rank (fp32), and saves for
backward within 20% of the planned activation bytes. One spawn per world size.
"""

from __future__ import annotations

from collections import Counter

import pytest
from fidelity import measure
from harness import Case, run_ranks

import autopar
from autopar.config import ParallelConfig as C
from autopar.models import zoo

CASES_2 = [
    Case("gpt-tiny", C(tp=2)),
    Case("llama-tiny", C(tp=2, sequence_parallel=True)),
    Case("llama-tiny", C(fsdp=2, zero_stage=3)),
    Case("gpt-tiny", C(fsdp=2, zero_stage=3, micro_batch_size=1), global_batch_size=4),
]
CASES_4 = [Case("gpt-tiny", C(dp=2, tp=2)), Case("llama-tiny", C(dp=2, tp=2))]


def plan_of(case: Case) -> autopar.Plan:
    model = zoo.build(case.model, device="meta")
    (ids,) = zoo.example_inputs(case.model, model)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=case.config.world_size)
    return autopar.evaluate(
        model,
        cluster,
        case.config,
        (ids,),
        global_batch_size=case.global_batch_size,
        precision="fp32",
    )


def predicted(plan: autopar.Plan) -> tuple[Counter, int]:
    """{(kind, bytes): calls} without the loss part, and the loss part's calls."""
    exact: Counter = Counter()
    loss = 0
    for c in plan.communication[0]:
        if c["part"] == "loss":
            loss += c["count"]
        else:
            exact[(c["kind"], float(c["bytes"]))] += c["count"]
    return exact, loss


def check(cases: list[Case], world_size: int) -> list[str]:
    per_rank = run_ranks(world_size, measure, cases)
    rows = []
    for i, case in enumerate(cases):
        plan = plan_of(case)
        got = Counter(per_rank[0][i]["comm"])
        exact, loss = predicted(plan)
        loss_sizes = {k for k in got if k not in exact and k[0] == "all_reduce" and k[1] < 1024}
        measured_loss = sum(got.pop(k) for k in loss_sizes)
        assert dict(got) == dict(exact), f"{case.label}: measured {dict(got)} != plan {dict(exact)}"
        assert measured_loss == loss, f"{case.label}: loss all-reduces {measured_loss} != {loss}"
        mem = plan.stages[0].memory_bytes
        for rank in per_rank:
            for key in ("parameters", "gradients", "optimizer"):
                assert rank[i]["memory"][key] == mem[key], (
                    f"{case.label}: {key} {rank[i]['memory'][key]} B != plan {mem[key]} B"
                )
        act = per_rank[0][i]["activations"]
        ratio = act / mem["activations"]
        rows.append(
            f"{case.label}: activations {act:.0f} B vs plan {mem['activations']:.0f} B "
            f"({ratio:.2f})"
        )
        assert 0.8 <= ratio <= 1.2, rows[-1]
    return rows


@pytest.mark.multiprocess
def test_one_step_on_2_ranks_does_what_the_plan_says():
    print("\n".join(check(CASES_2, 2)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_step_on_4_ranks_does_what_the_plan_says():
    print("\n".join(check(CASES_4, 4)))
