"""Tests of cost_models.pipeline: closed forms from the papers, torch's own schedule orders as the
reference for the per-rank orders, and invariants of the event simulation on random inputs.

Legend: p stages (ranks), m micro-batches, v chunks per rank, f / bi / bw the forward, input- and
weight-gradient times of one micro-batch on one rank, c the p2p latency.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from itertools import pairwise

import pytest

from cost_models.pipeline import PipelineResult, PipelineTask, simulate_pipeline
from cost_models.pipeline_bound import step_lower_bound

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe_v")
SPLIT_BACKWARD = {"zero_bubble", "dualpipe_v"}


def _uniform(
    schedule: str,
    p: int,
    m: int,
    *,
    f: float = 1.0,
    bi: float = 2.0,
    bw: float = 0.0,
    c: float = 0.0,
    v: int | None = None,
) -> PipelineResult:
    return simulate_pipeline(
        schedule,
        p,
        m,
        forward_s=[f] * p,
        backward_input_s=[bi] * p,
        backward_weight_s=[bw] * p,
        p2p_s=c,
        virtual_stages=v,
    )


def _virtual_stage(schedule: str, stage: int, chunk: int, p: int) -> int:
    """Written out again here, not imported, so a wrong layout in the module shows."""
    if schedule == "dualpipe_v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


# ---- closed forms for uniform stages ----


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(p: int, m: int) -> None:
    for schedule in ("gpipe", "1f1b"):
        result = _uniform(schedule, p, m)  # f=1, b=2, w=0: integers, so exact in floats
        assert result.bubble_fraction == (p - 1) / m, schedule
        assert result.step_time_s == (m + p - 1) * (1.0 + 2.0), schedule


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p: int, rounds: int, v: int) -> None:
    # Narayanan et al. 2021, sec. 2.2.2: bubble time (p - 1)(f + b) / v over ideal m (f + b).
    m = rounds * p
    result = _uniform("interleaved_1f1b", p, m, v=v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m), rel=1e-9)
    assert result.bubble_fraction < _uniform("1f1b", p, m).bubble_fraction


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_first_rank_holds_p_plus_p_minus_1_over_v(p: int, v: int) -> None:
    # Korthikanti et al. 2022: the first rank of interleaved 1F1B holds p (1 + (p - 1) / (p v))
    # micro-batches' activations: warm-up 2 (p - 1) + (v - 1) p chunk forwards plus one more.
    result = _uniform("interleaved_1f1b", p, 2 * p, v=v)
    assert result.peak_inflight_microbatches[0] == pytest.approx(p + (p - 1) / v)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("extra_m", [0, 1, 5, 8])
@pytest.mark.parametrize("f, bi, bw", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)])
def test_zero_bubble_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(
    p: int, extra_m: int, f: float, bi: float, bw: float
) -> None:
    # Qi et al. 2023: with m >= p and w <= f, ZB-H1 shrinks 1F1B's bubble (p - 1)(f + b + w) to
    # (p - 1)(f + b - w) by filling the drain with deferred W passes.
    m = p + extra_m
    zb = _uniform("zero_bubble", p, m, f=f, bi=bi, bw=bw)
    one_f_one_b = _uniform("1f1b", p, m, f=f, bi=bi, bw=bw)
    assert zb.step_time_s == pytest.approx(m * (f + bi + bw) + (p - 1) * (f + bi - bw))
    assert zb.step_time_s < one_f_one_b.step_time_s
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_over_p", [2, 3, 4])
def test_dualpipe_v_beats_1f1b_and_zb_h1(p: int, m_over_p: int) -> None:
    m = m_over_p * p
    dualpipe = _uniform("dualpipe_v", p, m, f=1.0, bi=1.0, bw=1.0)
    assert dualpipe.virtual_stages == 2  # the schedule's default
    assert dualpipe.step_time_s < _uniform("1f1b", p, m, f=1.0, bi=1.0, bw=1.0).step_time_s
    assert dualpipe.step_time_s < _uniform("zero_bubble", p, m, f=1.0, bi=1.0, bw=1.0).step_time_s


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_stage_has_no_bubble(schedule: str) -> None:
    result = _uniform(schedule, 1, 4, f=1.0, bi=1.5, bw=0.5)
    assert result.step_time_s == 4 * 3.0
    assert result.bubble_fraction == 0.0


# ---- peak in-flight micro-batches ----


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
def test_peak_inflight_1f1b_gpipe_zb(p: int, m: int) -> None:
    one_f_one_b = _uniform("1f1b", p, m).peak_inflight_microbatches
    assert one_f_one_b == tuple(float(p - i) for i in range(p))
    assert _uniform("gpipe", p, m).peak_inflight_microbatches == (float(m),) * p
    # ZB-H1 keeps 1F1B's warm-up, so its peak over ranks is 1F1B's, p (Qi et al. 2023). A
    # micro-batch counts until its W ends (W needs the layer inputs), so rank s, which defers
    # s W passes, holds p too where 1F1B's rank s holds p - s.
    zb = _uniform("zero_bubble", p, m, f=1.0, bi=1.0, bw=1.0).peak_inflight_microbatches
    assert max(zb) == max(one_f_one_b) == p
    assert zb == (float(p),) * p


def test_peak_inflight_1f1b_is_capped_by_m() -> None:
    assert _uniform("1f1b", 4, 2).peak_inflight_microbatches == (2.0, 2.0, 2.0, 1.0)


# ---- p2p latency ----


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("c", [0.1, 0.25, 3.0])
def test_p2p_latency_on_1f1b(p: int, c: float) -> None:
    # Fill and drain: one micro-batch goes down p - 1 links and its gradient back up p - 1, so
    # for m <= 2 the step grows by exactly 2 (p - 1) c. In the steady state rank 0 holds p
    # micro-batches, so its forward of micro-batch k + p waits for the backward of k, a round
    # trip of p forwards, p backwards and 2 (p - 1) sends: every further p micro-batches add
    # p (f + b) + 2 (p - 1) c. So for m = 1 + q p the latency costs 2 (p - 1) c (q + 1).
    for m in (1, 2):
        extra = _uniform("1f1b", p, m, c=c).step_time_s - _uniform("1f1b", p, m).step_time_s
        assert extra == pytest.approx(2 * (p - 1) * c)
    for q in (1, 2, 3):
        m = 1 + q * p
        extra = _uniform("1f1b", p, m, c=c).step_time_s - _uniform("1f1b", p, m).step_time_s
        assert extra == pytest.approx(2 * (p - 1) * c * (q + 1))


def _hops(schedule: str, p: int, m: int, hops: list[float], v: int | None = None) -> float:
    return simulate_pipeline(
        schedule, p, m, forward_s=[1.0] * p, backward_input_s=[2.0] * p,
        backward_weight_s=[0.5] * p, p2p_s=hops, virtual_stages=v,
    ).step_time_s  # fmt: skip


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_each_hop_adds_its_own_latency(p: int) -> None:
    # A micro-batch's round trip crosses each hop twice. GPipe runs every forward, then every
    # backward: its step grows by exactly 2 sum(c) at any m. 1F1B's fill and drain (m <= 2)
    # grow alike; with more micro-batches rank 0's round trip recurs every p of them (as in
    # test_p2p_latency_on_1f1b), so m = 1 + q p costs at least 2 sum(c) (q + 1), and no more
    # than every hop at the slowest one's latency. The wrap hop (last entry) is never crossed.
    hops = [0.4 / (k + 1) for k in range(p - 1)]
    total, zero = sum(hops), [0.0] * p
    for wrap in (0.0, 9.0):
        for m in (1, 2, 5, 9):
            extra = _hops("gpipe", p, m, [*hops, wrap]) - _hops("gpipe", p, m, zero)
            assert extra == pytest.approx(2 * total)
        for m in (1, 2):
            extra = _hops("1f1b", p, m, [*hops, wrap]) - _hops("1f1b", p, m, zero)
            assert extra == pytest.approx(2 * total)
        for q in (1, 2):
            m = 1 + q * p
            extra = _hops("1f1b", p, m, [*hops, wrap]) - _hops("1f1b", p, m, zero)
            slowest = _hops("1f1b", p, m, [max(hops)] * p) - _hops("1f1b", p, m, zero)
            assert 2 * total * (q + 1) - 1e-9 <= extra <= slowest + 1e-9
    same = _uniform("1f1b", 4, 9, bw=0.5, c=0.3).step_time_s
    assert _hops("1f1b", 4, 9, [0.3] * 4) == pytest.approx(same)


def test_interleaved_crosses_the_wrap_hop_and_a_v_does_not() -> None:
    # Interleaved chunks go from the last rank back to the first; a V turns on the last rank
    # and climbs back over the same links, so only its first p - 1 hops count.
    p, m = 4, 8
    zero = [0.0] * p
    wrap = [0.0, 0.0, 0.0, 0.5]
    assert _hops("interleaved_1f1b", p, m, wrap, 2) > _hops("interleaved_1f1b", p, m, zero, 2)
    assert _hops("dualpipe_v", p, m, wrap, 2) == _hops("dualpipe_v", p, m, zero, 2)
    assert _hops("dualpipe_v", p, m, [0.0, 0.5, 0.0, 0.0], 2) > _hops("dualpipe_v", p, m, zero, 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_p2p_between_chunks_on_one_rank(schedule: str) -> None:
    # One rank holds every chunk: nothing is sent, so the latency cannot show.
    assert _uniform(schedule, 1, 4, c=5.0).step_time_s == _uniform(schedule, 1, 4).step_time_s


def test_dualpipe_v_turns_at_the_bottom_without_a_send() -> None:
    # The last rank holds virtual stages p - 1 and p: micro-batch 0 goes straight from one to
    # the other, while every hop between ranks waits c.
    p, c = 4, 0.5
    tasks = _uniform("dualpipe_v", p, 2 * p, c=c).tasks
    forward = {(t.stage, t.chunk): t for t in tasks if t.kind == "F" and t.microbatch == 0}
    assert forward[(p - 1, 1)].start_s == forward[(p - 1, 0)].end_s
    assert forward[(1, 0)].start_s == forward[(0, 0)].end_s + c


# ---- invariants on random inputs ----


def _random_case(rng: random.Random) -> tuple[str, int, int, int, PipelineResult, list]:
    schedule = rng.choice(SCHEDULES)
    p = rng.randint(1, 5)
    v = {"interleaved_1f1b": rng.randint(2, 3), "dualpipe_v": 2}.get(schedule, 1)
    if schedule == "interleaved_1f1b":
        m = p * rng.randint(1, 3)
    elif schedule == "dualpipe_v":
        m = rng.randint(2 * p, 3 * p + 2)
    else:
        m = rng.randint(1, 3 * p + 2)
    times = [[rng.uniform(0.1, 2.0) for _ in range(p)] for _ in range(3)]
    c = rng.choice([0.0, rng.uniform(0.0, 0.5)])
    result = simulate_pipeline(
        schedule,
        p,
        m,
        forward_s=times[0],
        backward_input_s=times[1],
        backward_weight_s=times[2],
        p2p_s=c,
        virtual_stages=v,
    )
    return schedule, p, m, v, result, times + [c]


@pytest.mark.parametrize("seed", range(60))
def test_invariants_on_random_inputs(seed: int) -> None:
    schedule, p, m, v, result, (f, bi, bw, c) = _random_case(random.Random(seed))
    kinds = ("F", "B", "W") if schedule in SPLIT_BACKWARD else ("F", "B")
    by_stage: dict[int, list[PipelineTask]] = {s: [] for s in range(p)}
    for task in result.tasks:
        by_stage[task.stage].append(task)

    # Exactly one F and B (and W) per micro-batch and chunk on every stage.
    counts = Counter((t.stage, t.microbatch, t.chunk, t.kind) for t in result.tasks)
    expected = {
        (s, i, k, kind) for s in range(p) for i in range(m) for k in range(v) for kind in kinds
    }
    assert set(counts) == expected
    assert set(counts.values()) == {1}

    for s, tasks in by_stage.items():
        tasks.sort(key=lambda t: t.start_s)
        for before, after in pairwise(tasks):  # one task at a time
            assert after.start_s >= before.end_s - 1e-9
        busy = sum(t.end_s - t.start_s for t in tasks)  # work conserved
        assert busy == pytest.approx(m * (f[s] + bi[s] + bw[s]))
        assert result.busy_s[s] == pytest.approx(busy)

    end = {
        (t.kind, t.microbatch, _virtual_stage(schedule, t.stage, t.chunk, p)): t
        for t in result.tasks
    }
    for (kind, i, j), task in end.items():
        if kind == "F" and j > 0:
            before = end[("F", i, j - 1)]
            hop = c if before.stage != task.stage else 0.0
            assert task.start_s >= before.end_s + hop - 1e-9
        if kind == "B":
            assert task.start_s >= end[("F", i, j)].end_s - 1e-9
            if j < p * v - 1:
                after = end[("B", i, j + 1)]
                hop = c if after.stage != task.stage else 0.0
                assert task.start_s >= after.end_s + hop - 1e-9
        if kind == "W":
            assert task.start_s >= end[("B", i, j)].end_s - 1e-9

    assert result.step_time_s == max(t.end_s for t in result.tasks)
    busiest = max(result.busy_s)
    assert result.bubble_fraction == pytest.approx((result.step_time_s - busiest) / busiest)
    assert all(1 / v <= peak <= m for peak in result.peak_inflight_microbatches)
    # the search's pruning bound never exceeds the step, and is at least the busiest rank's
    bound = step_lower_bound(
        schedule, p, m, forward_s=f, backward_input_s=bi, backward_weight_s=bw, virtual_stages=v
    )
    assert busiest - 1e-9 <= bound <= result.step_time_s + 1e-9


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 32)])
def test_the_lower_bound_is_the_step_of_uniform_1f1b(p: int, m: int) -> None:
    # the F chain before the last rank and the B chain after the first: (m + p - 1)(f + b)
    result, kw = _uniform("1f1b", p, m), dict(forward_s=[1.0] * p, backward_weight_s=[0.0] * p)
    bound = step_lower_bound("1f1b", p, m, backward_input_s=[2.0] * p, **kw)
    assert bound == pytest.approx(result.step_time_s) == pytest.approx((m + p - 1) * 3.0)


# ---- torch's schedules as the reference for the per-rank orders ----


def _torch_order(schedule_cls: type, p: int, m: int, v: int, rank: int, split: bool) -> list:
    """torch's per-rank action list, as (kind, micro-batch, virtual stage). Reads torch's private
    _calculate_single_rank_operations: codegen runs these classes, so a change there should fail
    here."""
    schedule = object.__new__(schedule_cls)
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = p, m, v
    schedule.rank, schedule.num_stages, schedule._num_stages = rank, p * v, p * v
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    order = []
    for action in schedule._calculate_single_rank_operations(rank):
        for sub in (action.sub_actions or (action,)) if action is not None else ():
            kind = {"I": "B"}.get(sub.computation_type.value, sub.computation_type.value)
            order.append((kind, sub.microbatch_index, sub.stage_index))
            if sub.computation_type.value == "B" and split:  # full backward = B then W here
                order.append(("W", sub.microbatch_index, sub.stage_index))
    return order


@pytest.mark.parametrize(
    "schedule, class_name, v",
    [
        ("interleaved_1f1b", "ScheduleInterleaved1F1B", 2),
        ("interleaved_1f1b", "ScheduleInterleaved1F1B", 3),
        ("zero_bubble", "ScheduleInterleavedZeroBubble", 1),
        ("dualpipe_v", "ScheduleDualPipeV", 2),
    ],
)
def test_orders_match_torch_schedules(schedule: str, class_name: str, v: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for p in range(1, 6):
        for m in range(1, 4 * p + 1):
            if (schedule == "interleaved_1f1b" and m % p) or (
                schedule == "dualpipe_v" and m < 2 * p
            ):
                continue
            result = _uniform(schedule, p, m, f=1.0, bi=1.0, bw=1.0, v=v)
            for rank in range(p):
                ours = sorted((t for t in result.tasks if t.stage == rank), key=lambda t: t.start_s)
                ours_order = [
                    (t.kind, t.microbatch, _virtual_stage(schedule, rank, t.chunk, p)) for t in ours
                ]
                split = schedule in SPLIT_BACKWARD
                theirs = _torch_order(getattr(schedules, class_name), p, m, v, rank, split)
                assert ours_order == theirs, (p, m, rank)


# ---- input validation and printing ----


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"schedule": "pipedream"}, "schedule"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_microbatches": 0}, "num_microbatches"),
        ({"virtual_stages": 0}, "virtual_stages"),
        ({"forward_s": [1.0, 1.0]}, "forward_s"),
        ({"backward_weight_s": [0.0, -1.0, 0.0, 0.0]}, "backward_weight_s[1]"),
        ({"backward_input_s": [float("nan")] * 4}, "backward_input_s[0]"),
        ({"p2p_s": -0.1}, "p2p_s"),
        ({"p2p_s": [0.1, 0.1, 0.1]}, "p2p_s has 3 entries, need one or num_stages=4"),
        ({"p2p_s": [0.1, 0.1, -0.1, 0.1]}, "p2p_s"),
        ({"virtual_stages": 2}, "virtual_stages == 1, got 2"),
        ({"schedule": "interleaved_1f1b", "num_microbatches": 6}, "num_microbatches (6)"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, "virtual_stages >= 2, got 1"),
        ({"schedule": "dualpipe_v", "virtual_stages": 3}, "virtual_stages == 2, got 3"),
        (
            {"schedule": "dualpipe_v", "num_microbatches": 7},
            "num_microbatches (7) >= 2 * num_stages (8)",
        ),
    ],
)
def test_bad_input_raises_naming_the_field(overrides: dict, field: str) -> None:
    kwargs = {
        "schedule": "1f1b",
        "num_stages": 4,
        "num_microbatches": 8,
        "forward_s": [1.0] * 4,
        "backward_input_s": [1.0] * 4,
        "backward_weight_s": [1.0] * 4,
    } | overrides
    with pytest.raises(ValueError, match=re.escape(field)):
        simulate_pipeline(**kwargs)


def test_as_text_has_a_row_per_stage() -> None:
    text = _uniform("1f1b", 4, 8, f=1.0, bi=1.0, bw=1.0).as_text()
    assert "1f1b" in text and "bubble 37.50%" in text
    assert len(text.splitlines()) == 3 + 4
