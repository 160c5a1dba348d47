"""Event simulation of pipeline-parallel training schedules.

In: a schedule name, ``p`` pipeline ranks ("stages"), ``m`` micro-batches, ``v`` chunks per rank,
per-rank times ``f_s`` (forward), ``b_s`` (input-gradient backward) and ``w_s`` (weight-gradient
backward) for one micro-batch through all of rank ``s``'s layers, and a p2p latency ``c`` (one
for every hop, or one per hop: ``c_s`` between rank ``s`` and rank ``s + 1 mod p``).
Out: a ``PipelineResult`` holding every task's start and end, the step time, the bubble and the
peak number of micro-batch activations each rank holds. Invariant: every rank runs exactly one
F, one B (and one W where backward is split) per micro-batch and chunk, so its busy time is
``m (f_s + b_s + w_s)`` whatever the schedule.

Model
-----
Virtual stage ``j`` in ``0 .. p v - 1`` is chunk ``k`` of rank ``s`` by the schedule's layout
(``_looped``: ``j = k p + s``; ``_v_shape``: ``j = s`` for ``k = 0`` and ``j = 2p - 1 - s`` for
``k = 1``, so rank 0 holds the first and the last chunk). Task durations (``simulate_pipeline``)::

    F = f_s / v,   B = b_s / v,   W = w_s / v        schedules that split backward
    F = f_s / v,   B = (b_s + w_s) / v,   no W       the others

Dependencies (``_simulate``), with ``c(j, j')`` the latency of the hop between the ranks of
``j`` and ``j'`` (neighbours, or the last and the first rank) and 0 when they are one rank::

    F(i, j) >= end F(i, j - 1) + c(j - 1, j)                          j > 0
    B(i, j) >= end F(i, j),  and >= end B(i, j + 1) + c(j + 1, j)     j < p v - 1
    W(i, j) >= end B(i, j)

Rank ``s`` runs its tasks ``t_1, t_2, ...`` in the order its schedule's generator yields
(``_SCHEDULES``), one at a time (``_simulate``)::

    start(t_n) = max(end(t_{n-1}), ready(t_n)),   end(t_n) = start(t_n) + duration(t_n)

Outputs (``simulate_pipeline``)::

    T         = max over tasks of end                              step_time_s
    busy_s    = sum of rank s's durations = m (f_s + b_s + w_s)    busy_s
    bubble    = (T - max_s busy_s) / max_s busy_s                  bubble_fraction
    peak_s    = max over t of (1/v) #{(i, k) on rank s: F started by t, last backward not
                ended by t}                                        peak_inflight (_peak_held)

The last backward is W where backward is split: W needs the inputs of every weight-bearing op,
most of a layer's activations (Qi et al. 2023's M_W against M_B), and torch's stage_backward_input
keeps that part of the autograd graph, saved tensors included, alive until W. So ZB-H1 holds p
micro-batches on every rank where 1F1B holds p - s; its "same peak memory as 1F1B" is the max
over ranks.

Closed forms the simulation reproduces for uniform stages (tests/cost_models/test_pipeline.py):
GPipe and 1F1B bubble ``(p - 1) / m`` and 1F1B step ``(m + p - 1)(f + b)``; interleaved 1F1B
``(p - 1) / (v m)`` (Narayanan et al. 2021, sec. 2.2.2) and first-rank peak ``p + (p - 1) / v``
(Korthikanti et al. 2022); ZB-H1 bubble time ``(p - 1)(f + b - w)`` (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe_v"]
TaskKind = Literal["F", "B", "W"]
_Op = tuple[TaskKind, int, int]  # (kind, micro-batch, local chunk) as a rank runs it


@dataclass(frozen=True)
class PipelineTask:
    """One F, B or W of one micro-batch on one chunk of one rank, placed in time."""

    stage: int
    microbatch: int
    chunk: int
    kind: TaskKind
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    """What one simulated training step of a pipeline schedule costs."""

    schedule: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    step_time_s: float
    bubble_fraction: float  # (step_time - busiest stage's busy time) / busiest stage's busy time
    busy_s: tuple[float, ...]  # per stage
    # Per stage: max over time of micro-batch activations held, in units of one micro-batch's
    # activations for the whole stage (one chunk of an interleaved or V schedule counts 1/v).
    peak_inflight_microbatches: tuple[float, ...]
    tasks: tuple[PipelineTask, ...]  # for Gantt charts

    def as_text(self) -> str:
        """A header line and one row per stage: busy time, idle time, peak in-flight."""
        lines = [
            f"pipeline {self.schedule}: {self.num_stages} stages x {self.virtual_stages} chunks,"
            f" {self.num_microbatches} micro-batches",
            f"step {self.step_time_s:.6g} s, bubble {self.bubble_fraction:.2%} of the busiest"
            " stage's busy time",
            f"{'stage':>5} {'busy_s':>12} {'idle_s':>12} {'peak_inflight':>14}",
        ]
        for stage, (busy, peak) in enumerate(
            zip(self.busy_s, self.peak_inflight_microbatches, strict=True)
        ):
            idle = self.step_time_s - busy
            lines.append(f"{stage:>5} {busy:>12.6g} {idle:>12.6g} {peak:>14.4g}")
        return "\n".join(lines)


# ---- per-rank orders: one generator per schedule, yielding (kind, micro-batch, chunk) ----


def _gpipe(rank: int, p: int, m: int, v: int) -> Iterator[_Op]:
    """All forwards, then all backwards in micro-batch order (torch's ScheduleGPipe)."""
    for i in range(m):
        yield ("F", i, 0)
    for i in range(m):
        yield ("B", i, 0)


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> Iterator[_Op]:
    """p - rank - 1 warm-up forwards, then one forward and one backward (PipeDream-Flush)."""
    warmup = min(m, p - rank - 1)
    for i in range(warmup):
        yield ("F", i, 0)
    for i in range(m - warmup):
        yield ("F", warmup + i, 0)
        yield ("B", i, 0)
    for i in range(m - warmup, m):
        yield ("B", i, 0)


def _interleaved_1f1b(rank: int, p: int, m: int, v: int) -> Iterator[_Op]:
    """Megatron-LM's interleaved order, as torch's ScheduleInterleaved1F1B (what codegen runs)
    lays it out: the k-th forward runs chunk (k mod p v) // p on micro-batch (k // p v) p + k mod p,
    backwards walk the chunks in reverse, warm-up is 2 (p - rank - 1) + (v - 1) p forwards.
    Megatron alone runs all forwards first when m == p: same step time, more memory."""
    total = m * v
    warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)

    def op(kind: TaskKind, k: int) -> _Op:
        group, in_group = divmod(k, p * v)
        chunk = in_group // p
        return (kind, group * p + k % p, v - 1 - chunk if kind == "B" else chunk)

    for k in range(warmup):
        yield op("F", k)
    for k in range(total - warmup):
        yield op("F", warmup + k)
        yield op("B", k)
    for k in range(total - warmup, total):
        yield op("B", k)


def _zero_bubble_h1(rank: int, p: int, m: int, v: int) -> Iterator[_Op]:
    """ZB-H1: 1F1B's order and warm-up with W split off B; rank s defers its first s W passes
    to fill the drain bubble (torch's ScheduleInterleavedZeroBubble with one chunk per rank)."""
    warmup = min(m, p - rank - 1)
    next_w = 0
    for i in range(warmup):
        yield ("F", i, 0)
    for i in range(m):
        if warmup + i < m:
            yield ("F", warmup + i, 0)
        yield ("B", i, 0)
        if i >= rank:
            yield ("W", next_w, 0)
            next_w += 1
    for i in range(next_w, m):
        yield ("W", i, 0)


def _dualpipe_v(rank: int, p: int, m: int, v: int) -> Iterator[_Op]:
    """DualPipe-V (DeepSeek's "cut-in-half" DualPipe), step for step as torch's
    ScheduleDualPipeV lays it out. Chunk 0 is virtual stage rank, chunk 1 is 2p - 1 - rank.
    An overlapped F&B pair (which hides the all-to-all of one behind the other's compute) runs
    here as F then B then W, because this model has no intra-rank communication to hide."""
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    pending_w: list[tuple[int, int]] = []  # (micro-batch, chunk) whose W is deferred

    def run(kind: Literal["F", "B", "BW"], chunk: int) -> Iterator[_Op]:
        key = ("F", chunk) if kind == "F" else ("B", chunk)
        i = count[key]
        count[key] = i + 1
        yield ("F" if kind == "F" else "B", i, chunk)
        if kind == "BW":  # full backward: input and weight gradient back to back
            yield ("W", i, chunk)
        elif kind == "B":
            pending_w.append((i, chunk))

    def deferred_w() -> Iterator[_Op]:
        if pending_w:
            i, chunk = pending_w.pop(0)
            yield ("W", i, chunk)

    for _ in range(2 * (p - rank - 1)):  # step 1: F0
        yield from run("F", 0)
    for _ in range(rank + 1):  # step 2: F0 F1
        yield from run("F", 0)
        yield from run("F", 1)
    for _ in range(p - rank - 1):  # step 3: B1 W F1 (zero bubble)
        yield from run("B", 1)
        yield from deferred_w()
        yield from run("F", 1)
    for _ in range(m - 2 * p + rank + 1):  # step 4 (main): F0&B1, F1&B0
        yield from run("F", 0)
        yield from run("BW", 1)
        yield from run("F", 1)
        yield from run("BW", 0)
    for _ in range(p - rank - 1):  # step 5: B1, F1&B0
        yield from run("BW", 1)
        yield from run("F", 1)
        yield from run("BW", 0)
    split = False
    for i in range(rank + 1):  # step 6: B1 B0, the second half split (zero bubble)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        yield from run("B" if split else "BW", 1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        yield from run("B" if split else "BW", 0)
    for _ in range(p - rank - 1):  # step 7: W B0
        yield from deferred_w()
        yield from run("B" if split else "BW", 0)
    for _ in range(rank + 1):  # step 8: W
        yield from deferred_w()


# ---- layouts of virtual stages on ranks ----


def _looped(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def _v_shape(rank: int, chunk: int, p: int) -> int:
    return rank if chunk == 0 else 2 * p - 1 - rank


def _single_chunk(p: int, m: int, v: int) -> str | None:
    return None if v == 1 else f"needs virtual_stages == 1, got {v}"


def _interleaved_rule(p: int, m: int, v: int) -> str | None:
    if v < 2:
        return f"needs virtual_stages >= 2, got {v} (use '1f1b' for one chunk per stage)"
    if m % p:
        return f"needs num_microbatches ({m}) to be a multiple of num_stages ({p})"
    return None


def _dualpipe_v_rule(p: int, m: int, v: int) -> str | None:
    if v != 2:
        return f"needs virtual_stages == 2, got {v}"
    if m < 2 * p:  # DeepSeek's dualpipev.py and torch's ScheduleDualPipeV require it too
        return f"needs num_microbatches ({m}) >= 2 * num_stages ({2 * p})"
    return None


@dataclass(frozen=True)
class _ScheduleSpec:
    order: Callable[[int, int, int, int], Iterator[_Op]]  # (rank, p, m, v) -> ops
    layout: Callable[[int, int, int], int]  # (rank, chunk, p) -> virtual stage
    splits_backward: bool
    default_virtual_stages: int
    rule: Callable[[int, int, int], str | None]  # (p, m, v) -> why not, or None


_SCHEDULES: MappingProxyType[str, _ScheduleSpec] = MappingProxyType(
    {
        "gpipe": _ScheduleSpec(_gpipe, _looped, False, 1, _single_chunk),
        "1f1b": _ScheduleSpec(_one_f_one_b, _looped, False, 1, _single_chunk),
        "interleaved_1f1b": _ScheduleSpec(_interleaved_1f1b, _looped, False, 2, _interleaved_rule),
        "zero_bubble": _ScheduleSpec(_zero_bubble_h1, _looped, True, 1, _single_chunk),
        "dualpipe_v": _ScheduleSpec(_dualpipe_v, _v_shape, True, 2, _dualpipe_v_rule),
    }
)


# ---- the shared simulator ----


@functools.lru_cache(maxsize=256)
def _prepared(
    schedule: str, p: int, m: int, v: int
) -> tuple[tuple[tuple[str, int, int, int], ...], ...]:
    """Every rank's ops as (kind, micro-batch, chunk, virtual stage): they depend only on the
    schedule's shape, not on the times, so the search reuses them (a pure memo)."""
    spec = _SCHEDULES[schedule]
    return tuple(
        tuple(
            (kind, i, chunk, spec.layout(s, chunk, p)) for kind, i, chunk in spec.order(s, p, m, v)
        )
        for s in range(p)
    )


def _checked(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int | None,
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    p2p_s: float | Sequence[float],
) -> tuple[_ScheduleSpec, int, list[dict[str, float]]]:
    """(schedule spec, chunks per rank v, per rank the duration of one F, B and W task), the
    inputs validated; raises what `simulate_pipeline` says."""
    v = virtual_stages
    if v is None and schedule in _SCHEDULES:
        v = _SCHEDULES[schedule].default_virtual_stages
    times = {
        "forward_s": forward_s,
        "backward_input_s": backward_input_s,
        "backward_weight_s": backward_weight_s,
    }
    spec = _validate(schedule, num_stages, num_microbatches, v, times, p2p_s)
    v = int(v)
    durations = [  # an unsplit schedule's B is input and weight gradient together
        {"F": f / v, "B": (bi if spec.splits_backward else bi + bw) / v, "W": bw / v}
        for f, bi, bw in zip(forward_s, backward_input_s, backward_weight_s, strict=True)
    ]
    return spec, v, durations


def _links(
    prepared: tuple, spec: _ScheduleSpec, v: int, c: float | Sequence[float]
) -> tuple[int, list[float], list[float], dict[str, list[list[float | None]]]]:
    """(last virtual stage, p2p latency into each virtual stage from the one before and from
    the one after: the hop's c across ranks, 0 within one, empty end-time tables
    end[kind][i][j])."""
    p = len(prepared)
    rank_of = {spec.layout(s, k, p): s for s in range(p) for k in range(v)}
    last = p * v - 1
    per_hop = [float(c)] if isinstance(c, numbers.Real) else [float(x) for x in c]
    per_hop *= p // len(per_hop)  # one for every hop

    def hop(j: int) -> float:  # the link between virtual stages j and j + 1, either way
        a, b = rank_of[j], rank_of[j + 1]
        if a == b:
            return 0.0
        if abs(a - b) == 1:
            return per_hop[min(a, b)]  # down the pipeline, or a V's way back up
        return per_hop[p - 1]  # the last rank's chunk hands on to the first rank's next

    between = [hop(j) for j in range(last)]
    hop_prev = [0.0, *between]
    hop_next = [*between, 0.0]
    m = 1 + max((op[1] for ops in prepared for op in ops), default=0)
    # end[kind][micro-batch][virtual stage]; lists index faster than dicts of tuples
    end = {kind: [[None] * (last + 1) for _ in range(m)] for kind in ("F", "B", "W")}
    return last, hop_prev, hop_next, end


def _simulate(
    prepared: tuple[tuple[tuple[str, int, int, int], ...], ...],
    durations: list[dict[str, float]],
    spec: _ScheduleSpec,
    v: int,
    c: float | Sequence[float],
) -> list[list[float]]:
    """Start time of every rank's tasks, advancing each rank as far as its dependencies allow.

    The search prices thousands of configs, so this loop works on plain tuples and dicts.
    """
    p = len(prepared)
    last, hop_prev, hop_next, end = _links(prepared, spec, v, c)
    end_f, end_b = end["F"], end["B"]
    pos, free = [0] * p, [0.0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in prepared)
    while remaining:
        progressed = False
        for s in range(p):
            ops, k, t_free, dur = prepared[s], pos[s], free[s], durations[s]
            while k < len(ops):
                kind, i, _chunk, j = ops[k]
                if kind == "F":
                    ready = 0.0
                    if j > 0:
                        done = end_f[i][j - 1]
                        if done is None:
                            break
                        ready = done + hop_prev[j]
                elif kind == "B":
                    ready = end_f[i][j]
                    if ready is None:
                        break
                    if j < last:
                        done = end_b[i][j + 1]
                        if done is None:
                            break
                        if done + hop_next[j] > ready:
                            ready = done + hop_next[j]
                else:
                    ready = end_b[i][j]
                    if ready is None:
                        break
                start = t_free if t_free > ready else ready
                t_free = start + dur[kind]
                end[kind][i][j] = t_free
                starts[s].append(start)
                k += 1
            if k != pos[s]:
                progressed = True
                remaining -= k - pos[s]
                pos[s], free[s] = k, t_free
        if not progressed:
            stuck = {s: prepared[s][pos[s]][:3] for s in range(p) if pos[s] < len(prepared[s])}
            raise RuntimeError(f"pipeline order deadlocks; next tasks per stage: {stuck}")
    return starts


@functools.lru_cache(maxsize=256)
def _peak_held(schedule: str, p: int, m: int, v: int) -> tuple[float, ...]:
    """Per rank, the max over time of (#F started - #last-backward ended) / v.

    A rank runs its ops one at a time in order, so an op's release (the end of its B, or W for
    split schedules) comes before the next op starts: the time order of these events is the op
    order, releases first on ties. The peak is a running count over the order and does not
    depend on the times (a pure memo, like `_prepared`)."""
    release = "W" if _SCHEDULES[schedule].splits_backward else "B"
    peaks = []
    for ops in _prepared(schedule, p, m, v):
        held = peak = 0
        for kind, *_ in ops:
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind == release:
                held -= 1
        peaks.append(peak / v)
    return tuple(peaks)


def _validate(
    schedule: str,
    p: int,
    m: int,
    v: int,
    times: dict[str, Sequence[float]],
    p2p_s: float | Sequence[float],
) -> _ScheduleSpec:
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {sorted(_SCHEDULES)}")
    for name, count in (("num_stages", p), ("num_microbatches", m), ("virtual_stages", v)):
        if not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    for name, values in times.items():
        if len(values) != p:
            raise ValueError(f"{name} has {len(values)} entries, need num_stages={p}")
        for stage, value in enumerate(values):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}[{stage}]={value!r} must be finite and >= 0")
    hops = [p2p_s] if isinstance(p2p_s, numbers.Real) else list(p2p_s)
    if len(hops) not in (1, p):
        raise ValueError(f"p2p_s has {len(hops)} entries, need one or num_stages={p}")
    if not all(math.isfinite(c) and c >= 0 for c in hops):
        raise ValueError(f"p2p_s={p2p_s!r} must be finite and >= 0")
    spec = _SCHEDULES[schedule]
    why_not = spec.rule(int(p), int(m), int(v))
    if why_not:
        raise ValueError(f"schedule={schedule!r} {why_not}")
    return spec


def simulate_pipeline(
    schedule: Schedule,
    num_stages: int,
    num_microbatches: int,
    *,
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    p2p_s: float | Sequence[float] = 0.0,
    virtual_stages: int | None = None,
    record_tasks: bool = True,
) -> PipelineResult:
    """Simulate one training step of ``schedule`` and time every task (model: module docstring).

    Args:
        schedule: "gpipe", "1f1b", "interleaved_1f1b" (Megatron order), "zero_bubble" (ZB-H1)
            or "dualpipe_v" (DualPipe-V, two chunks per rank in a V).
        num_stages: pipeline ranks p.
        num_microbatches: micro-batches m per step.
        forward_s, backward_input_s, backward_weight_s: per rank, seconds for one micro-batch
            through all of the rank's layers; schedules that do not split backward run input and
            weight gradient as one B task.
        p2p_s: latency of one activation or gradient send between ranks: one for every hop,
            or per rank s the hop between s and s + 1 (the last: back to rank 0, which
            interleaved and V schedules cross) where the links differ.
        virtual_stages: chunks per rank v; None takes the schedule's default (2 for
            interleaved_1f1b and dualpipe_v, else 1).
        record_tasks: keep every task in the result (for Gantt charts); the search turns it
            off and reads only the step time and the peaks.

    Returns:
        A PipelineResult with the step time, bubble, per-stage busy time and peak in-flight
        micro-batches, and every task.

    Raises:
        ValueError: an unknown schedule, a non-positive count, a time list whose length is not
            num_stages, a negative or non-finite time, or a (p, m, v) the schedule cannot run
            (interleaved_1f1b needs m % p == 0 and v >= 2; dualpipe_v needs v == 2, m >= 2p).

    Example:
        >>> r = simulate_pipeline("1f1b", 4, 8, forward_s=[1.0] * 4,
        ...     backward_input_s=[1.0] * 4, backward_weight_s=[1.0] * 4)
        >>> r.step_time_s, r.bubble_fraction
        (33.0, 0.375)
    """
    spec, v, durations = _checked(
        schedule, num_stages, num_microbatches, virtual_stages,
        forward_s, backward_input_s, backward_weight_s, p2p_s,
    )  # fmt: skip
    p, m = int(num_stages), int(num_microbatches)
    prepared = _prepared(schedule, p, m, v)
    starts = _simulate(prepared, durations, spec, v, p2p_s)
    busy = tuple(sum(durations[s][op[0]] for op in prepared[s]) for s in range(p))
    step = max(
        (st[-1] + durations[s][prepared[s][-1][0]] for s, st in enumerate(starts) if st),
        default=0.0,
    )
    busiest = max(busy)
    tasks = (
        [
            PipelineTask(s, i, chunk, kind, t, t + durations[s][kind])
            for s in range(p)
            for (kind, i, chunk, _j), t in zip(prepared[s], starts[s], strict=True)
        ]
        if record_tasks
        else []
    )
    return PipelineResult(
        schedule=schedule,
        num_stages=p,
        num_microbatches=m,
        virtual_stages=v,
        step_time_s=step,
        bubble_fraction=(step - busiest) / busiest if busiest > 0 else 0.0,
        busy_s=busy,
        peak_inflight_microbatches=_peak_held(schedule, p, m, v),
        tasks=tuple(sorted(tasks, key=lambda t: (t.start_s, t.stage))),
    )


def peak_inflight_microbatches(
    schedule: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[float, ...]:
    """Per rank, the peak in-flight micro-batches `simulate_pipeline` reports, without
    simulating: the peak follows the op order alone (`_peak_held`), not the times.

    >>> peak_inflight_microbatches("1f1b", 4, 8)
    (4.0, 3.0, 2.0, 1.0)
    """
    _validate(schedule, num_stages, num_microbatches, virtual_stages, {}, 0.0)
    return _peak_held(schedule, num_stages, num_microbatches, virtual_stages)
