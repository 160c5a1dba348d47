"""Property tests (hypothesis) for the cost models: invariants over random inputs.

Communication: every algorithm's time is non-negative and never falls as the message grows,
on random hierarchical topologies and tori. Pipeline: the simulator conserves work (each rank
runs one F, one B and, where backward is split, one W per micro-batch and chunk, so its busy
time is m (f + b + w) whatever the schedule), never runs two tasks at once on one rank, and
respects the data dependencies between virtual stages. Memory: ZeRO never makes a device hold
more, and sharding wider never does either.
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cost_models.comm import (
    COLLECTIVES,
    HierarchicalGroup,
    Level,
    Torus,
    TorusGroup,
    collective_options,
    ring_all_reduce_bytes_per_rank,
)
from cost_models.memory import model_state_bytes
from cost_models.pipeline import simulate_pipeline

_SIZES = st.floats(min_value=0, max_value=2**34, allow_nan=False)


@st.composite
def hierarchical_groups(draw) -> HierarchicalGroup:
    num_levels = draw(st.integers(1, 3))
    levels, ranks, domain = [], [], 1
    for i in range(num_levels):
        domain *= draw(st.integers(1, 8))
        last = i == num_levels - 1
        levels.append(
            Level(
                name=f"l{i}",
                devices_per_domain=0 if last else domain,
                bandwidth_bytes_per_s=draw(st.floats(1e8, 1e12)),
                latency_s=draw(st.floats(0, 1e-4)),
                efficiency=draw(st.floats(0.05, 1.0)),
                in_network_reduction_efficiency=draw(st.none() | st.floats(0.05, 1.0)),
            )
        )
        ranks.append(domain)
    return HierarchicalGroup(tuple(levels), tuple(ranks))


@st.composite
def torus_groups(draw) -> TorusGroup:
    dims = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    torus = Torus(
        num_dims=len(dims),
        max_shape=tuple(dims),
        link_bandwidth_bytes_per_s=draw(st.floats(1e9, 1e11)),
        latency_s=draw(st.floats(0, 1e-5)),
        efficiency=draw(st.floats(0.1, 1.0)),
        wraparound_min_size=4,
    )
    wrap = tuple(d >= 4 for d in dims)
    return TorusGroup(torus, tuple(dims), wrap)


@settings(max_examples=150, deadline=None)
@given(
    group=hierarchical_groups() | torus_groups(),
    collective=st.sampled_from(COLLECTIVES),
    a=_SIZES,
    b=_SIZES,
)
def test_collective_times_are_non_negative_and_monotone_in_size(group, collective, a, b):
    small, large = sorted((a, b))
    before = {e.algorithm: e.time_s for e in collective_options(collective, small, group)}
    after = {e.algorithm: e.time_s for e in collective_options(collective, large, group)}
    assert before.keys() == after.keys() and before
    for algorithm, t_small in before.items():
        assert math.isfinite(t_small) and t_small >= 0
        assert after[algorithm] >= t_small * (1 - 1e-12), algorithm


@given(n=st.integers(1, 4096), a=_SIZES, b=_SIZES)
def test_ring_volume_is_non_negative_monotone_and_below_twice_the_message(n, a, b):
    small, large = sorted((a, b))
    v_small = ring_all_reduce_bytes_per_rank(small, n)
    assert 0 <= v_small <= ring_all_reduce_bytes_per_rank(large, n)
    assert v_small <= 2 * small


_SCHEDULE_SHAPES = st.sampled_from(
    [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2),
     ("interleaved_1f1b", 3), ("dualpipe_v", 2)]
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(
    shape=_SCHEDULE_SHAPES,
    p=st.integers(1, 5),
    m=st.integers(1, 12),
    data=st.data(),
    p2p=st.floats(0, 0.5),
)
def test_pipeline_conserves_work_and_never_overlaps_a_rank(shape, p, m, data, p2p):
    schedule, v = shape
    times = st.lists(st.floats(0.01, 3.0), min_size=p, max_size=p)
    f, b, w = data.draw(times), data.draw(times), data.draw(times)
    try:
        result = simulate_pipeline(
            schedule, p, m, forward_s=f, backward_input_s=b, backward_weight_s=w,
            p2p_s=p2p, virtual_stages=v,
        )  # fmt: skip
    except ValueError:
        assume(False)  # a (p, m, v) the schedule cannot run: refused, as documented
        return
    splits = schedule in ("zero_bubble", "dualpipe_v")
    kinds = ("F", "B", "W") if splits else ("F", "B")
    for s in range(p):
        mine = sorted((t for t in result.tasks if t.stage == s), key=lambda t: t.start_s)
        # conservation: one task of each kind per micro-batch and chunk, the stated busy time
        assert sorted((t.kind, t.microbatch, t.chunk) for t in mine) == sorted(
            (k, i, c) for k in kinds for i in range(m) for c in range(v)
        )
        assert math.isclose(result.busy_s[s], m * (f[s] + b[s] + w[s]), rel_tol=1e-9)
        assert math.isclose(sum(t.end_s - t.start_s for t in mine), result.busy_s[s], rel_tol=1e-9)
        # one task at a time
        for prev, nxt in zip(mine, mine[1:], strict=False):
            assert nxt.start_s >= prev.end_s - 1e-9
    assert result.step_time_s >= max(result.busy_s) - 1e-9
    assert result.step_time_s == max(t.end_s for t in result.tasks)
    # within a micro-batch: backward of a chunk after its forward, W after B
    by_key = {(t.stage, t.chunk, t.microbatch, t.kind): t for t in result.tasks}
    for (s, c, i, kind), t in by_key.items():
        if kind == "B":
            assert t.start_s >= by_key[(s, c, i, "F")].end_s - 1e-9
        if kind == "W":
            assert t.start_s >= by_key[(s, c, i, "B")].end_s - 1e-9


@given(
    params=st.floats(1, 1e12),
    precision=st.sampled_from(["bf16", "fp16", "fp32"]),
    optimizer=st.sampled_from(["adamw", "adam", "sgd", "sgd_momentum"]),
    shard=st.integers(2, 4096),
)
def test_zero_never_holds_more_and_wider_sharding_never_holds_more(
    params, precision, optimizer, shard
):
    def total(zero: int, degree: int) -> float:
        state = model_state_bytes(
            params, precision=precision, optimizer=optimizer, zero_stage=zero,
            shard_degree=degree,
        )  # fmt: skip
        assert min(state.parameters_bytes, state.gradients_bytes, state.optimizer_bytes) >= 0
        return state.total_bytes

    stages = [total(z, shard) for z in (0, 1, 2, 3)]
    assert all(
        later <= earlier * (1 + 1e-12) for earlier, later in zip(stages, stages[1:], strict=False)
    )
    for zero in (1, 2, 3):
        assert total(zero, shard * 2) <= total(zero, shard) * (1 + 1e-12)
