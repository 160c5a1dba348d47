"""Compute measurements on this rank's device: matmul, attention, memory copy, elementwise.

In: the device, a `ComputePlan` (which sizes), and a progress callback. Out: a list of
`ComputeMeasurement` (op, dtype, shape, FLOPs, bytes moved, seconds), the raw points that
`autopar.profiler.document` fits efficiency curves to. Every rank runs the same ops at the same
time, so a measurement includes the contention of the ranks sharing the machine (on a CPU, one
core each under torchrun's default of one thread per rank).

Timing: a call is run once to warm up (allocation, kernel selection), then ``repeats`` times a
batch of calls sized to take about ``target_s``; the time of one call is the best batch's mean
(as `timeit` advises: slower batches were slowed by something else, not by the op).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Progress = Callable[[str], None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A call this long is timed once more, not in batches, and no larger size of its op is timed:
# its rate is the large-size rate (launch overhead is microseconds). Without it, bf16 matmuls
# on an AVX2 CPU (1 GFLOP/s, no bf16 units) took 7 of a 9-minute profile on 2026-11-29.
SLOW_CALL_S = 1.0


@dataclass(frozen=True)
class ComputeMeasurement:
    op: str  # "matmul", "attention", "copy", "add", "launch"
    dtype: str
    shape: str  # "m x k x n", "b x h x s x d", or the element count
    flops: float
    bytes_moved: float
    time_s: float


@dataclass(frozen=True)
class ComputePlan:
    """Which sizes to measure. `quick` is a handful of points for tests (seconds, not minutes)."""

    matmul_sizes: tuple[int, ...]
    attention_seq_lens: tuple[int, ...]
    memory_numels: tuple[int, ...]
    attention_dtype: str
    target_s: float
    repeats: int

    @classmethod
    def for_device(cls, device: torch.device, *, quick: bool) -> ComputePlan:
        gpu = device.type == "cuda"
        if quick:  # best of 4 short batches: a batch or two lost to a busy machine's other
            # processes (the suite's) still leaves a clean one, so the curves rise with size;
            # the memory sizes span 256x up to 128 MiB, where the bytes outweigh any stall
            # (2**16-2**24 fitted a falling line in two suite runs under load)
            return cls((64, 256, 512), (128, 512), (2**17, 2**20, 2**23, 2**25), "fp32", 0.01, 4)
        matmul = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
        seq = (64, 128, 256, 512, 1024, 2048)
        numels = tuple(2**k for k in range(10, 27, 2))
        if gpu:
            matmul = matmul + (4096, 8192)
            seq = seq + (4096, 8192)
            numels = numels + (2**28,)
        # Attention in the dtype training runs in there: bf16 on a GPU, fp32 on a CPU.
        return cls(matmul, seq, numels, "bf16" if gpu else "fp32", 0.05, 5)


def time_call(
    fn: Callable[[], object], device: torch.device, *, target_s: float, repeats: int
) -> float:
    """Seconds of one ``fn()`` call: best of ``repeats`` batches of about ``target_s`` each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = _one_call(fn, sync)
    if first >= SLOW_CALL_S:  # a call of seconds is its own long batch: one more is enough
        calls, repeats = 1, 1
    else:  # the batch's size from the best of three calls: one stalled call (a busy machine
        # preempting this process) would size batches of one call, each as stalled
        first = min(first, _one_call(fn, sync), _one_call(fn, sync))
        calls = max(1, min(10_000, int(target_s / first)))
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _one_call(fn: Callable[[], object], sync: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return max(time.perf_counter() - start, 1e-7)


def measure_compute(
    device: torch.device, plan: ComputePlan, progress: Progress
) -> list[ComputeMeasurement]:
    """Run every measurement of ``plan`` on ``device``; see the module docstring."""
    out = [launch_op(device, plan)]
    progress(f"launch overhead {out[0].time_s * 1e6:.1f} us")
    for name in DTYPES:
        for n in plan.matmul_sizes:
            m = matmul_op(device, plan, name, n)
            out.append(m)
            progress(f"matmul {name} {m.shape}: {m.flops / m.time_s / 1e9:.1f} GFLOP/s")
            if m.time_s >= SLOW_CALL_S:  # a CPU without bf16 units: 1 GFLOP/s, and the
                # larger sizes would take minutes each at a rate this one already shows
                progress(f"matmul {name}: {m.time_s:.1f} s a call at {m.shape}, larger skipped")
                break
    for s in plan.attention_seq_lens:
        m = _attention(device, plan, s)
        out.append(m)
        progress(f"attention {m.dtype} {m.shape}: {m.flops / m.time_s / 1e9:.1f} GFLOP/s")
    memory_ops = {"copy": copy_op, "add": add_op}
    points = [fn(device, plan, n) for fn in memory_ops.values() for n in plan.memory_numels]
    # both ops stream memory: the curve is fitted to them together, so one stalled at its
    # largest size bends it whichever op it is (a copy of 256 MiB slower than an add of
    # 384 MiB fitted a falling curve in a suite run): retimed against each other by bytes
    points = _retime_stalls(
        sorted(points, key=lambda m: m.bytes_moved),
        lambda m: memory_ops[m.op](device, plan, int(m.shape)),
        progress,
    )
    out += points
    for m in points:
        size = int(m.shape) * 4 / 2**20
        progress(f"{m.op} {size:g} MiB: {m.bytes_moved / m.time_s / 1e9:.2f} GB/s")
    return out


def _retime_stalls(
    points: list[ComputeMeasurement],
    measure: Callable[[ComputeMeasurement], ComputeMeasurement],
    progress: Progress,
    rounds: int = 3,
) -> list[ComputeMeasurement]:
    """``points`` of memory-bound ops, by growing bytes moved, with each point slower than a
    larger one timed again (up to ``rounds`` times), its best kept. Streaming fewer bytes
    cannot take longer than streaming more: such a point was stalled by another process in
    every batch (a busy machine: under the test suite's load, the quick profile fitted a
    falling memory curve and refused to write the profile). Its time only falls when retimed,
    so the curve's points are no slower than the ops."""
    points = list(points)
    for _ in range(rounds):
        stalled = [
            i
            for i, m in enumerate(points)
            if any(m.time_s > later.time_s for later in points[i + 1 :])
        ]
        if not stalled:
            break
        for i in stalled:
            again = measure(points[i])
            if again.time_s < points[i].time_s:
                points[i] = again
        progress(f"memory: retimed {len(stalled)} point(s) slower than a larger one")
    return points


def launch_op(device: torch.device, plan: ComputePlan) -> ComputeMeasurement:
    # One tiny op: what every op pays before doing any work (dispatch, kernel launch).
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    c = torch.empty(1, device=device)
    t = time_call(lambda: torch.add(a, b, out=c), device, target_s=plan.target_s, repeats=5)
    return ComputeMeasurement("launch", "fp32", "1", 1.0, 12.0, t)


def matmul_op(device: torch.device, plan: ComputePlan, dtype: str, n: int) -> ComputeMeasurement:
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    c = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    t = time_call(
        lambda: torch.mm(a, b, out=c), device, target_s=plan.target_s, repeats=plan.repeats
    )
    return ComputeMeasurement(
        "matmul", dtype, f"{n}x{n}x{n}", 2.0 * n**3, 3.0 * n * n * a.element_size(), t
    )


def _attention(device: torch.device, plan: ComputePlan, seq: int) -> ComputeMeasurement:
    # Forward, not causal: QK^T and PV, 2 * 2 * b * h * s^2 * d FLOPs.
    b, h, d = 1, 8, 64
    dtype = DTYPES[plan.attention_dtype]
    q, k, v = (torch.randn(b, h, seq, d, device=device, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        t = time_call(
            lambda: F.scaled_dot_product_attention(q, k, v),
            device,
            target_s=plan.target_s,
            repeats=plan.repeats,
        )
    return ComputeMeasurement(
        "attention",
        plan.attention_dtype,
        f"{b}x{h}x{seq}x{d}",
        4.0 * b * h * seq * seq * d,
        4.0 * b * h * seq * d * q.element_size(),
        t,
    )


def copy_op(device: torch.device, plan: ComputePlan, numel: int) -> ComputeMeasurement:
    src = torch.randn(numel, device=device)
    dst = torch.empty(numel, device=device)
    t = time_call(lambda: dst.copy_(src), device, target_s=plan.target_s, repeats=plan.repeats)
    return ComputeMeasurement("copy", "fp32", str(numel), 0.0, 8.0 * numel, t)


def add_op(device: torch.device, plan: ComputePlan, numel: int) -> ComputeMeasurement:
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    c = torch.empty(numel, device=device)
    t = time_call(
        lambda: torch.add(a, b, out=c), device, target_s=plan.target_s, repeats=plan.repeats
    )
    return ComputeMeasurement("add", "fp32", str(numel), float(numel), 12.0 * numel, t)
