"""Collective cost model: formulas, algorithm choice, and published measurements."""

from __future__ import annotations

import math

import pytest

from cost_models.comm import (
    COLLECTIVES,
    HierarchicalGroup,
    Level,
    Torus,
    TorusGroup,
    collective_options,
    collective_time,
    ring_all_reduce_bytes_per_rank,
)

GiB = 2**30
NVLINK = Level("nvlink", 8, 450e9, 3e-6, 0.82, 0.61)
IB = Level("ib", 0, 50e9, 10e-6, 0.94)


def test_ring_all_reduce_volume_is_2_n_minus_1_over_n():
    s = 1e9
    for n in (2, 4, 8, 64):
        assert ring_all_reduce_bytes_per_rank(s, n) == pytest.approx(2 * (n - 1) / n * s)
        # The priced ring moves exactly that volume at the link rate (no latency here).
        level = Level("x", 0, 100e9, 0.0, 1.0)
        ring = next(
            e
            for e in collective_options("all_reduce", s, HierarchicalGroup((level,), (n,)))
            if e.algorithm == "ring"
        )
        assert ring.time_s * 100e9 == pytest.approx(2 * (n - 1) / n * s)


def test_cheapest_algorithm_is_returned():
    group = HierarchicalGroup((NVLINK, IB), (8, 64))
    for collective in COLLECTIVES:
        for size in (1e3, 1e6, 1e9):
            options = collective_options(collective, size, group)
            best = collective_time(collective, size, group)
            assert best.time_s == min(o.time_s for o in options)


def test_tree_wins_small_messages_ring_wins_large_ones():
    group = HierarchicalGroup((Level("ib", 0, 50e9, 10e-6, 0.94),), (8,))
    assert collective_time("all_reduce", 4096, group).algorithm == "tree"
    assert collective_time("all_reduce", 1 * GiB, group).algorithm == "ring"


def test_hierarchical_wins_when_the_outer_link_is_much_slower():
    # 8 ranks per domain on a fast link, a slow shared uplink: reduce inside the domain first so
    # only 1/8 of the data crosses, instead of a ring that crosses with the whole buffer.
    fast = Level("fast", 8, 400e9, 1e-6, 1.0)
    slow = Level("slow", 0, 1e9, 1e-5, 1.0)
    group = HierarchicalGroup((fast, slow), (8, 16))
    s = 1 * GiB
    best = collective_time("all_reduce", s, group)
    assert best.algorithm == "hierarchical"
    inner = HierarchicalGroup((fast,), (8,))
    outer = HierarchicalGroup((slow,), (2,))
    phases = (
        collective_time("reduce_scatter", s, inner).time_s
        + collective_time("all_reduce", s / 8, outer).time_s
        + collective_time("all_gather", s, inner).time_s
    )
    assert best.time_s == pytest.approx(phases)


def test_all_to_all_is_bound_by_the_share_that_leaves_the_node():
    group = HierarchicalGroup((NVLINK, IB), (8, 16))
    s = 1 * GiB
    t = collective_time("all_to_all", s, group).time_s
    # Half of each rank's data goes to the other node over its own NIC.
    expected = 15 * IB.latency_s + (8 / 16) * s / (0.94 * 50e9)
    assert t == pytest.approx(expected)


def test_torus_wraparound_doubles_the_gather_bandwidth():
    torus = Torus(3, (16, 16, 16), 45e9, 1e-6, 1.0, 4)
    s = 1 * GiB
    ring = collective_time("all_gather", s, TorusGroup(torus, (4,), (True,))).time_s
    line = collective_time("all_gather", s, TorusGroup(torus, (4,), (False,))).time_s
    bandwidth_term = 3 / 4 * s / 45e9
    assert line - 3e-6 == pytest.approx(bandwidth_term)
    assert ring - 3e-6 == pytest.approx(bandwidth_term / 2)
    # A 3D group uses the links of all three dims at once.
    cube = collective_time("all_reduce", s, TorusGroup(torus, (4, 4, 4), (True,) * 3)).time_s
    assert cube == pytest.approx(2 * (9e-6 + 63 / 64 * s / (45e9 * 6)))


def test_times_grow_with_message_size_and_are_never_negative():
    groups = [
        HierarchicalGroup((NVLINK,), (8,)),
        HierarchicalGroup((NVLINK, IB), (8, 32)),
        TorusGroup(Torus(2, (16, 16), 45e9, 1e-6, 0.9, 16), (16, 16), (True, True)),
    ]
    for group in groups:
        for collective in COLLECTIVES:
            times = [collective_time(collective, 2.0**k, group).time_s for k in range(0, 36, 5)]
            assert all(t >= 0 for t in times)
            assert times == sorted(times), (collective, times)


def test_single_rank_group_is_free():
    est = collective_time("all_reduce", 1e9, HierarchicalGroup((NVLINK,), (1,)))
    assert est.time_s == 0.0 and est.algorithm == "local"


def test_bad_input_is_refused():
    group = HierarchicalGroup((NVLINK,), (8,))
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        collective_time("allreduce", 1e6, group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="message_bytes must be >= 0, got -1"):
        collective_time("all_reduce", -1, group)
    with pytest.raises(ValueError, match="ranks_per_domain"):
        HierarchicalGroup((NVLINK, IB), (8,))


def test_bus_bandwidth_follows_nccl_tests():
    group = HierarchicalGroup((Level("x", 0, 100e9, 0.0, 1.0),), (8,))
    est = collective_time("all_gather", 1e9, group)
    assert est.bus_bandwidth_bytes_per_s == pytest.approx(100e9)
    assert math.isclose(est.bus_bandwidth_bytes_per_s, 1e9 / est.time_s * 7 / 8)


def test_ring_latency_counts_the_steps_on_each_level():
    # 16 ranks on 2 nodes of 8: a ring's 15 steps are 14 NVLink hops and 1 network hop
    # (NCCL's tuning model counts nNodes-1 inter-node steps per pass the same way).
    nvlink = Level("nvlink", 8, 1e12, 2e-6, 1.0)
    net = Level("net", 0, 1e12, 10e-6, 1.0)
    group = HierarchicalGroup((nvlink, net), (8, 16))
    ring = next(e for e in collective_options("all_gather", 0.0, group) if e.algorithm == "ring")
    assert ring.time_s == pytest.approx(14 * 2e-6 + 1 * 10e-6)
    tree = next(e for e in collective_options("all_reduce", 0.0, group) if e.algorithm == "tree")
    # chains of 8 inside each node, a tree of depth log2(2) = 1 across the nodes, up and down
    assert tree.time_s == pytest.approx(2 * (7 * 2e-6 + 1 * 10e-6))


def test_a_collective_latency_overrides_the_level_latency_for_that_collective_only():
    from cost_models.comm import HierarchicalGroup, Level, collective_time

    base = Level("loopback", 0, 1e9, 3e-4, 1.0)
    own = Level("loopback", 0, 1e9, 3e-4, 1.0, collective_latency_s=(("send_recv", 5e-5),))
    g_base, g_own = HierarchicalGroup((base,), (2,)), HierarchicalGroup((own,), (2,))
    assert collective_time("send_recv", 0, g_own).time_s == pytest.approx(5e-5)
    assert collective_time("send_recv", 0, g_base).time_s == pytest.approx(3e-4)
    for kind in ("all_reduce", "all_gather", "broadcast"):
        assert collective_time(kind, 1e6, g_own).time_s == collective_time(kind, 1e6, g_base).time_s
