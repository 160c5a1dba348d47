"""A rank never holds more of the model than its plan's share at startup (issue 44).

Models of a few hundred MB of fp32 weights (zoo Llama, 101 M parameters, 405 MB; zoo MoE,
8 experts, 86 M, 344 MB), on 4 gloo ranks forked afresh for each case (a forked process's peak
starts at its resident set), under FSDP4, TP2 x PP2 and EP2 over DP2 x FSDP2. Each rank reads
its peak resident set (VmHWM) when its first module forward begins (a global forward
pre-hook), and the test bounds it:

    peak <= resident set after imports and the process group + the plan's parameter bytes
            for that rank's stage + SLACK

SLACK (192 MiB) holds the startup's own temporaries: the replay's blocks of 2**18 elements
(`startup.materialize.BLOCK_ELEMENTS`: a few int64 and float64 tensors, about 16 MB), the
recorded build's graph, the mesh's and FSDP2's buffers. Building the whole model on each rank
first (what the program did before) puts 405 MB on every rank and fails the bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import Case, run_ranks, task_of

import autopar
from autopar.config import ParallelConfig as C
from autopar.models import zoo
from autopar.runtime.trainer import TrainOptions, train

MiB = 2**20
SLACK = 192 * MiB
LLAMA = {"hidden": 768, "num_heads": 12, "num_kv_heads": 6, "ffn_hidden": 2048,
         "num_layers": 8, "vocab_size": 32000}  # fmt: skip
MOE = {"hidden": 512, "num_heads": 8, "num_kv_heads": 4, "num_experts": 8,
       "expert_ffn_hidden": 1024, "num_layers": 4, "vocab_size": 32000}  # fmt: skip
CASES = [
    Case("llama-tiny", C(fsdp=4, zero_stage=3), global_batch_size=4, overrides=LLAMA),
    Case("llama-tiny", C(tp=2, pp=2), global_batch_size=4, overrides=LLAMA),
    Case("moe-tiny", C(dp=2, fsdp=2, ep=2, zero_stage=3), global_batch_size=4, overrides=MOE),
]


def _resident() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _peak() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _measure(case: Case) -> tuple[float, float, int]:
    """On one rank: resident bytes before startup, the peak when the first forward begins,
    and the pp rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    before = _resident()
    seen: list[float] = []

    def first_forward(module, args):
        if not seen:
            seen.append(_peak())

    hook = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
    try:
        options = TrainOptions(steps=1, log=False)
        train(task_of(case), case.config, case.global_batch_size, options=options)
    finally:
        hook.remove()
    pp_rank = dist.get_rank() // (dist.get_world_size() // case.config.pp)
    return before, seen[0], pp_rank


def _planned_parameters(case: Case) -> list[float]:
    model = zoo.build(case.model, device="meta", **case.overrides)
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=4)
    (ids,) = zoo.example_inputs(case.model, model)
    plan = autopar.evaluate(model, cluster, case.config, (ids,),
                            global_batch_size=case.global_batch_size)  # fmt: skip
    return [s.memory_bytes["parameters"] for s in plan.stages]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_startup_holds_the_plans_share_of_the_parameters(case):
    whole = sum(p.numel() * 4 for p in zoo.build(case.model, device="meta",
                **case.overrides).parameters())  # fmt: skip
    planned = _planned_parameters(case)
    for rank, (before, peak, stage) in enumerate(run_ranks(4, _measure, case)):
        grew = peak - before
        bound = planned[stage] + SLACK
        print(
            f"{case.label} rank {rank}: +{grew / MiB:.0f} MiB at the first forward (plan's "
            f"parameters {planned[stage] / MiB:.0f} MiB, whole model {whole / MiB:.0f} MiB)"
        )
        assert grew <= bound, (
            f"rank {rank} grew {grew / MiB:.0f} MiB before its first forward; the plan's share "
            f"is {planned[stage] / MiB:.0f} MiB (+{SLACK / MiB:.0f} slack)"
        )
