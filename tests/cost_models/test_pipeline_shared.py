"""The processor-sharing pipeline simulation against the plain one and hand-derived timelines."""

from __future__ import annotations

import random

import pytest

from cost_models.pipeline import simulate_pipeline
from cost_models.pipeline_shared import simulate_pipeline_shared

SHAPES = [
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 3, 5, 1),
    ("interleaved_1f1b", 4, 8, 2),
    ("zero_bubble", 4, 8, 1),
    ("zero_bubble", 2, 1, 1),
    ("dualpipe_v", 4, 8, 2),
]


def _times(rnd: random.Random, p: int) -> dict:
    return dict(
        forward_s=[rnd.uniform(0.5, 2) for _ in range(p)],
        backward_input_s=[rnd.uniform(0.5, 2) for _ in range(p)],
        backward_weight_s=[rnd.uniform(0, 1) for _ in range(p)],
        p2p_s=rnd.uniform(0, 0.3),
    )


@pytest.mark.parametrize("schedule,p,m,v", SHAPES)
def test_slots_to_spare_is_the_plain_simulation(schedule, p, m, v):
    rnd = random.Random(p * 100 + m)
    for _ in range(4):
        t = _times(rnd, p)
        plain = simulate_pipeline(schedule, p, m, virtual_stages=v, **t).step_time_s
        shared = simulate_pipeline_shared(
            schedule, p, m, virtual_stages=v, node_of=[0] * p, weight=[1] * p, slots=p, **t
        )
        assert shared == pytest.approx(plain, rel=1e-12)


@pytest.mark.parametrize("schedule,p,m,v", SHAPES)
def test_bounds(schedule, p, m, v):
    """Never faster than the work over the slots nor than unshared; sharing everything all
    the time (idle ranks loading as busy ones) is the plain simulation slowed by the share."""
    rnd = random.Random(7 * p + m)
    t = _times(rnd, p)
    plain = simulate_pipeline(schedule, p, m, virtual_stages=v, **t).step_time_s
    work = m * sum(t["forward_s"] + t["backward_input_s"] + t["backward_weight_s"])
    one_slot = simulate_pipeline_shared(
        schedule, p, m, virtual_stages=v, node_of=[0] * p, weight=[1] * p, slots=1, **t
    )
    assert one_slot >= work - 1e-9
    half = simulate_pipeline_shared(
        schedule, p, m, virtual_stages=v, node_of=[0] * p, weight=[2] * p, slots=p, **t
    )
    assert plain - 1e-9 <= half <= 2 * plain + 1e-9
    t_no_p2p = {**t, "p2p_s": 0.0}
    always = simulate_pipeline_shared(
        schedule, p, m, virtual_stages=v, node_of=[0] * p, weight=[2] * p, slots=p,
        idle_load=1.0, **t_no_p2p,
    )  # fmt: skip
    slow = {k: [2 * x for x in t_no_p2p[k]] for k in ("forward_s", "backward_input_s")}
    slow["backward_weight_s"] = [2 * x for x in t["backward_weight_s"]]
    expected = simulate_pipeline(schedule, p, m, virtual_stages=v, **slow).step_time_s
    assert always == pytest.approx(expected, rel=1e-9)


def test_gpipe_two_stages_one_slot_by_hand():
    """f = 1, b = 2 on both ranks, one slot: F0 alone [0, 1]; F1 on rank 0 with F0 on rank 1
    at half rate [1, 3]; F1 on rank 1 alone [3, 4]; B0 on rank 1 alone [4, 6]; B1 on rank 1
    and B0 on rank 0 at half rate [6, 10]; B1 on rank 0 alone [10, 12]."""
    step = simulate_pipeline_shared(
        "gpipe", 2, 2, forward_s=[1, 1], backward_input_s=[2, 2], backward_weight_s=[0, 0],
        node_of=[0, 0], weight=[1, 1], slots=1,
    )  # fmt: skip
    assert step == pytest.approx(12.0)


def test_one_micro_batch_runs_stages_at_the_full_rate():
    """A single micro-batch keeps one stage busy at a time: no sharing, whatever the weights
    (8 ranks of 2 stages on 2 slots would run at a quarter rate if all were busy)."""
    step = simulate_pipeline_shared(
        "gpipe", 4, 1, forward_s=[1, 2, 3, 4], backward_input_s=[2, 2, 2, 2],
        backward_weight_s=[0] * 4, node_of=[0] * 4, weight=[2] * 4, slots=2, p2p_s=0.5,
    )  # fmt: skip
    assert step == pytest.approx(10 + 8 + 6 * 0.5)


def test_nodes_do_not_share():
    """Two stages on two nodes never share a slot: the plain simulation at one slot each."""
    t = dict(forward_s=[1.0, 1.5], backward_input_s=[2.0, 2.5], backward_weight_s=[0.0, 0.0])
    plain = simulate_pipeline("1f1b", 2, 4, **t).step_time_s
    shared = simulate_pipeline_shared("1f1b", 2, 4, node_of=[0, 1], weight=[1, 1], slots=1, **t)
    assert shared == pytest.approx(plain)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(node_of=[0], weight=[1, 1], slots=1), "node_of and weight"),
        (dict(node_of=[0, 0], weight=[1, 0], slots=1), "must be > 0"),
        (dict(node_of=[0, 0], weight=[1, 1], slots=0), "must be > 0"),
        (dict(node_of=[0, 0], weight=[1, 1], slots=1, idle_load=1.5), "idle_load"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline_shared(
            "1f1b", 2, 2, forward_s=[1, 1], backward_input_s=[1, 1], backward_weight_s=[0, 0],
            **kwargs,
        )  # fmt: skip
