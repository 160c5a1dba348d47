"""What the training loop prints beside the plan: each step's line and, at the end, every rank's.

In: the loop's `StepResult`s, the plan's `Prediction`, the rank's `StartupReport` and when its
first step ended. Out: text on rank 0's standard output -- a line per step (loss, gradient
norm, time and memory against the plan's) and a line per rank (its memory, its startup's
seconds and peak host and device bytes against the plan's parameter bytes, its time to first
step), plus the busiest expert rank's routed rows under expert parallelism.

Public functions:
    step_line(result, steps, prediction, stage) -> str
    print_rank_summary(results, mesh, prediction, startup, first_step_s, memory,
                       host_released=None)  # collective
    mib(bytes) -> str
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from autopar.runtime.mesh import RuntimeMesh
    from autopar.runtime.startup.start import StartupReport
    from autopar.runtime.trainer import Prediction, StepResult

MiB = 2**20
# a CPU rank's resident peak over its plan's above which the allocator is named: a ratio, and
# an excess beyond the ~340 MiB the process's Python and torch hold (no tiny model's run hints)
HOST_PEAK_HINT_RATIO = 1.5
HOST_PEAK_HINT_EXCESS = 512 * MiB


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def step_line(r: StepResult, steps: int, pred: Prediction, stage: int) -> str:
    m = r.memory_bytes
    plan_mem = pred.stage_memory_bytes[stage] if pred.stage_memory_bytes else {}
    plan_time = f" (plan {pred.step_time_s:.4f} s)" if pred.step_time_s else ""
    return (
        f"step {r.step}/{steps}  loss {r.loss:.6f}  grad_norm {r.grad_norm:.6f}  "
        f"time {r.step_time_s:.4f} s{plan_time}  rank0 MiB params {mib(m['parameters'])}"
        f"/{mib(plan_mem.get('parameters'))} grads {mib(m['gradients'])}"
        f"/{mib(plan_mem.get('gradients'))} optim {mib(m['optimizer'])}"
        f"/{mib(plan_mem.get('optimizer'))} (measured/plan)"
    )


def print_rank_summary(
    results: list[StepResult],
    mesh: RuntimeMesh,
    pred: Prediction,
    startup: StartupReport,
    first_step_s: float | None,
    memory: dict[str, float],
    host_released: bool | None = None,
) -> None:
    """Every rank's memory (``memory``: after the last step, or after startup when there was
    none) and startup, gathered to rank 0 and printed one line each; under expert parallelism,
    the busiest rank's routed rows over the mean against the plan's assumption.
    ``host_released``: on CPU ranks, whether the allocator returns freed memory
    (`autopar.runtime.host_memory`); False adds a line where a rank's resident peak is well
    over its plan's, naming the option that brings it down (None: not a CPU run)."""
    sent = sum(r.routed_rows[0] for r in results)
    received = sum(r.routed_rows[1] for r in results)
    rows: list[Any] = [None] * dist.get_world_size()
    mine = (mesh.rank, mesh.pp_rank, memory, sent, received, startup, first_step_s)
    dist.all_gather_object(rows, mine)
    if mesh.rank != 0:
        return
    loads = {row[0]: row[4] / row[3] for row in rows if row[3]}
    if loads:
        busiest = max(loads, key=loads.get)
        planned = f"{pred.moe_imbalance:.2f}" if pred.moe_imbalance else "-"
        print(
            f"[autopar] expert rows: the busiest rank ({busiest}) received {loads[busiest]:.2f}x "
            f"the mean over {len(results)} steps (plan {planned}: CostOptions.moe_imbalance)",
            file=sys.stdout,
            flush=True,
        )
    over = []  # (rank, measured / planned peak) where the excess is large too
    for rank, stage, mem, _, _, start, first in rows:
        plan_peak = pred.stage_peak_bytes[stage] if pred.stage_peak_bytes else None
        if plan_peak and mem["peak"] - plan_peak > HOST_PEAK_HINT_EXCESS:
            over.append((rank, mem["peak"] / plan_peak))
        plan_mem = pred.stage_memory_bytes[stage] if pred.stage_memory_bytes else {}
        device = (
            "" if start.device_peak_bytes is None else (f" device {mib(start.device_peak_bytes)}")
        )
        first_text = "-" if not first else f"{first:.1f} s"
        print(
            f"[autopar] rank {rank} memory MiB: params {mib(mem['parameters'])} grads "
            f"{mib(mem['gradients'])} optim {mib(mem['optimizer'])} peak {mib(mem['peak'])}"
            f" (plan peak {mib(plan_peak)}); startup {start.seconds:.1f} s, peak MiB host "
            f"{mib(start.host_peak_bytes)}{device} (plan's parameters "
            f"{mib(plan_mem.get('parameters'))}); first step done {first_text} after start",
            file=sys.stdout,
            flush=True,
        )
    worst = max(over, key=lambda x: x[1], default=None)
    if host_released is False and worst and worst[1] > HOST_PEAK_HINT_RATIO:
        print(
            f"[autopar] rank {worst[0]}'s resident peak is {worst[1]:.1f}x its plan's: the "
            "host allocator keeps freed tensor memory; --release-host-memory hands it back "
            "(slower steps: autopar.runtime.host_memory)",
            file=sys.stdout,
            flush=True,
        )
