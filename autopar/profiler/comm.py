"""Communication measurements: collectives over message sizes and group sizes, per level.

In: the initialised default process group (gloo on CPUs, NCCL on GPUs), torchrun's
``GROUP_RANK`` (which node each rank is on) and a `CommPlan`. Out: a list of
`LevelMeasurement`, the raw points `autopar.profiler.document` fits alpha-beta to.

Levels (`discover_levels`). Ranks are grouped by node. On one node there is one level, the
whole machine (``devices_per_domain = 0``). On several there are two: the ranks of the first
node (``devices_per_domain`` = ranks per node), and one rank per node for the network between
them, so each group meets on exactly one level, as `cost_models.fit.fit_level` assumes.

Message sizes follow `cost_models.comm` (nccl-tests): the all-reduce buffer, the all-gather
output, the reduce-scatter input, each rank's all-to-all send buffer, the point-to-point
message. Send/recv is a ping-pong between a level's first two ranks, half a round trip each.
A timed batch starts after a barrier; its time is the slowest rank's, and the result is the best
of the repeats (as in `autopar.profiler.compute.time_call`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.profiler.compute import Progress

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
_FP32_BYTES = 4


@dataclass(frozen=True)
class LevelPlan:
    name: str
    devices_per_domain: int  # as in the profile; 0: the whole cluster
    members: tuple[int, ...]  # global ranks that meet on this level only


@dataclass(frozen=True)
class LevelMeasurement:
    level: str
    collective: str
    message_bytes: float
    group_size: int
    time_s: float


@dataclass(frozen=True)
class CommPlan:
    message_bytes: tuple[int, ...]
    target_s: float
    repeats: int

    @classmethod
    def default(cls, *, quick: bool) -> CommPlan:
        if quick:
            return cls((2**12, 2**16, 2**20, 2**22), 0.01, 2)
        return cls(tuple(2**k for k in range(10, 27, 2)), 0.1, 5)


def group_sizes(num_members: int) -> tuple[int, ...]:
    """Powers of two from 2 up to the level's rank count, and the count itself."""
    sizes = [2**k for k in range(1, num_members.bit_length()) if 2**k <= num_members]
    if num_members >= 2 and num_members not in sizes:
        sizes.append(num_members)
    return tuple(sizes)


def discover_levels(inner_name: str) -> tuple[LevelPlan, ...]:
    """The topology levels of this job, from every rank's torchrun ``GROUP_RANK``."""
    nodes: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    order = sorted(set(nodes), key=nodes.index)
    if len(order) == 1:
        return (LevelPlan(inner_name, 0, tuple(range(len(nodes)))),)
    first = tuple(r for r, node in enumerate(nodes) if node == order[0])
    heads = tuple(nodes.index(node) for node in order)
    return (LevelPlan(inner_name, len(first), first), LevelPlan("network", 0, heads))


def measure_comm(
    levels: tuple[LevelPlan, ...], plan: CommPlan, device: torch.device, progress: Progress
) -> list[LevelMeasurement]:
    """Time every collective of `KINDS` for each level, group size and message size."""
    rank = dist.get_rank()
    out: list[LevelMeasurement] = []
    for level in levels:
        for size in group_sizes(len(level.members)):
            ranks = level.members[:size]
            group = dist.new_group(list(ranks))  # every rank takes part in creating it
            if rank not in ranks:
                continue
            for kind in KINDS:
                if kind == "send_recv" and size != 2:
                    continue
                for nbytes in plan.message_bytes:
                    op, actual, messages = _collective(kind, nbytes, ranks, group, device)
                    t = _time(op, group, device, plan) / messages
                    out.append(LevelMeasurement(level.name, kind, actual, size, t))
                    progress(
                        f"{level.name} {kind} x{size} {actual / 2**20:g} MiB: "
                        f"{t * 1e6:.0f} us, {actual / t / 1e9:.2f} GB/s"
                    )
    dist.barrier()
    return out


def _collective(
    kind: str, nbytes: int, ranks: tuple[int, ...], group: object, device: torch.device
) -> tuple[Callable[[], object], float, int]:
    """The op that runs ``kind`` on about ``nbytes``, its exact bytes, and messages per call."""
    n = len(ranks)
    numel = max(n, nbytes // _FP32_BYTES // n * n)
    full = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * _FP32_BYTES, 1
    if kind == "all_gather":
        shard = torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return (lambda: gather(full, shard, group=group)), numel * _FP32_BYTES, 1
    if kind == "reduce_scatter":
        shard = torch.empty(numel // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return (lambda: scatter(shard, full, group=group)), numel * _FP32_BYTES, 1
    if kind == "all_to_all":
        received = torch.empty(numel, device=device)
        return (lambda: dist.all_to_all_single(received, full, group=group)), numel * _FP32_BYTES, 1
    rank, (first, second) = dist.get_rank(), ranks[:2]
    peer = second if rank == first else first

    def ping_pong() -> None:  # a round trip: two messages
        if rank == first:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)

    return ping_pong, numel * _FP32_BYTES, 2


def _time(op: Callable[[], object], group: object, device: torch.device, plan: CommPlan) -> float:
    """Seconds of one op: best repeat of the slowest rank's batch mean (module docstring)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flag = torch.zeros(1, device=device)

    def barrier() -> None:  # an all-reduce, which NCCL and gloo both do on any group
        dist.all_reduce(flag, group=group)
        sync()

    barrier()
    start = time.perf_counter()
    op()
    sync()
    first = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    calls = max(1, min(1000, int(plan.target_s / max(first.item(), 1e-7))))
    times = []
    for _ in range(plan.repeats):
        barrier()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        times.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(times, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.min())
