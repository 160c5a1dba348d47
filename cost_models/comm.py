"""Collective communication time on a group of ranks placed on the topology.

Message size S follows nccl-tests: the all-reduce buffer, the all-gather *output*, the
reduce-scatter *input*, each rank's whole all-to-all send buffer, the broadcast buffer, the
point-to-point message. A group of n ranks is described by how it lies on the topology
(`HierarchicalGroup` for GPU/CPU levels, `TorusGroup` for a TPU slice); every algorithm that
applies is priced and the cheapest is returned (`collective_time`).

Hierarchical topology (alpha-beta per level). Levels l = 0..L, innermost first; r_l is the
number of group ranks inside one domain of level l (r_L = n) and r_{-1} = 1. A ring crosses a
level-l boundary once per channel, and each of the r_{l-1} ranks of a level-(l-1) domain has its
own level-l link (a NIC per GPU), so r_{l-1} channels cross in parallel; the ring's bandwidth is
that of its slowest crossing (`_ring_bandwidth`):

    B_ring = min_l  eff_l * bw_l * r_{l-1}

    ring       all-reduce       2 A_ring + 2(n-1)/n * S / B_ring
               all-gather, RS      A_ring +  (n-1)/n * S / B_ring
               broadcast           A_ring +            S / B_ring     (pipelined chain)
    tree       all-reduce       2 A_tree + 2 S / B_ring     (chains inside domains, a double
               broadcast          A_tree +   S / B_ring      binary tree across the top level)

A ring's n-1 steps pay the latency of the link each step crosses: with D_l = n / r_l domains
of level l in the group (D_{-1} = n), (D_{l-1} - D_l) steps stay inside a level-l domain and
D_{L-1} - 1 cross the top level, so A_ring = sum_l steps_l a_l (NCCL's tuning model counts
intra- and inter-node steps the same way). A_tree = sum_{l<L} (r_l / r_{l-1} - 1) a_l +
ceil(log2 D_{L-1}) a_L (`_ring_latency`, `_tree_latency`).
    in-network all-reduce       2 a_L + S / min_l(inr_l * bw_l * r_{l-1})
               (NVLink SHARP / IB SHARP: every rank sends and receives S once; only where every
               level the group uses reduces in the switch)
    hierarchical (L >= 1)       all-reduce = RS inside the level-(L-1) domain (S)
                                 + all-reduce across domains (S / r_{L-1}, n / r_{L-1} ranks,
                                   the r_{L-1} shards in parallel, each on its own link)
                                 + AG inside the domain (S); each phase priced by its own
                                 cheapest algorithm. All-gather and reduce-scatter have no
                                 two-level form here: NCCL runs them as rings (its tuning model
                                 gives Tree to all-reduce only), and a two-level all-gather
                                 exists only where the runtime composes it, which HSDP (dp x
                                 fsdp) does and the planner's search covers. Pricing one here
                                 made 1,536-GPU ZeRO-3 look 2x faster than measured.
    all-to-all                  (n-1) a_L + max_l ((r_l - r_{l-1}) / n * S) / (eff_l * bw_l)
                                 (the share of each rank's data bound for ranks reached over
                                 level l, every level's links working at once)
    send/recv                   a_L + S / (eff_L * bw_L)

A level may give a collective its own latency (`Level.collective_latency_s`): every formula
above then reads that a_l for that collective (fitted per collective by `cost_models.fit`).

Torus (TPU ICI, `TorusGroup`): the group spans dims of sizes d_i; a dim with wraparound links is
a bidirectional ring (2 links per chip), without them a line that carries one direction's worth.
With k_i = 2 if wraparound else 1 and link bandwidth b (per direction):

    all-gather, RS   sum_i (d_i - 1) a + (N-1)/N * S / (eff * b * sum_i k_i)
    all-reduce       twice that (reduce-scatter then all-gather)
    broadcast        sum_i (d_i - 1) a + S / (eff * b * sum_i k_i)
    all-to-all       sum_i (d_i - 1) a + sum_i S * d_i / (4 k_i eff b)   (bisection bound per dim)
    send/recv        a + S / (eff * b)

The bus bandwidth reported with each estimate is nccl-tests' busbw: S / time times
2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

Collective = Literal[
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"
]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class Level:
    """One level of a hierarchical topology; bandwidth is per device, per direction."""

    name: str
    devices_per_domain: int  # 0: the whole cluster
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    in_network_reduction_efficiency: float | None = None
    # (collective, latency_s) pairs that replace latency_s for that collective: a runtime that
    # implements each collective its own way (gloo: a send/recv costs ~60 us on loopback, its
    # collectives 300-800 us) pays a different fixed cost per step for each, as NCCL's tuning
    # model has a base latency per algorithm and protocol; a collective not listed: latency_s
    collective_latency_s: tuple[tuple[str, float], ...] = ()

    def for_collective(self, collective: str) -> Level:
        """This level with ``latency_s`` the one ``collective`` pays (the table is kept, with
        the level's own latency under "default", so that a collective priced inside another
        -- the hierarchical all-reduce's reduce-scatter -- still finds its own)."""
        table = dict(self.collective_latency_s)
        table.setdefault("default", self.latency_s)
        latency = table.get(collective, table["default"])
        return replace(self, latency_s=latency, collective_latency_s=tuple(sorted(table.items())))


@dataclass(frozen=True)
class Torus:
    """A TPU slice's inter-chip interconnect; bandwidth is per link, per direction."""

    num_dims: int
    max_shape: tuple[int, ...]
    link_bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    wraparound_min_size: int


@dataclass(frozen=True)
class HierarchicalGroup:
    """A group on levels 0..L: ``ranks_per_domain[l]`` group ranks share one level-l domain."""

    levels: tuple[Level, ...]
    ranks_per_domain: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.ranks_per_domain) or not self.levels:
            raise ValueError("HierarchicalGroup needs one ranks_per_domain entry per level")
        if any(r < 1 for r in self.ranks_per_domain):
            raise ValueError(f"ranks_per_domain must be >= 1, got {self.ranks_per_domain}")

    @property
    def size(self) -> int:
        return self.ranks_per_domain[-1]


@dataclass(frozen=True)
class TorusGroup:
    """A group on a torus: the sizes of the dims it spans and whether each wraps around."""

    torus: Torus
    dim_sizes: tuple[int, ...]
    wraparound: tuple[bool, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dim_sizes)


Group = HierarchicalGroup | TorusGroup


@dataclass(frozen=True)
class CommEstimate:
    collective: str
    algorithm: str
    message_bytes: float
    group_size: int
    time_s: float

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """nccl-tests' busbw: algorithm bandwidth times the collective's volume factor."""
        if self.time_s <= 0:
            return math.inf
        return self.message_bytes / self.time_s * _bus_factor(self.collective, self.group_size)

    def as_text(self) -> str:
        return (
            f"{self.collective} of {self.message_bytes / 2**20:.2f} MiB over {self.group_size} "
            f"ranks: {self.algorithm}, {self.time_s * 1e6:.1f} us, "
            f"busbw {self.bus_bandwidth_bytes_per_s / 1e9:.1f} GB/s"
        )


def _bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def collective_time(collective: Collective, message_bytes: float, group: Group) -> CommEstimate:
    """The cheapest algorithm's estimate for one collective.

    Args:
        collective: one of COLLECTIVES.
        message_bytes: S, in the nccl-tests convention (module docstring).
        group: where the participating ranks lie.

    Returns:
        A CommEstimate; a group of one rank costs nothing.

    Raises:
        ValueError: unknown collective, negative size.
    """
    options = collective_options(collective, message_bytes, group)
    return min(options, key=lambda e: e.time_s)


def collective_options(
    collective: Collective, message_bytes: float, group: Group
) -> list[CommEstimate]:
    """Every applicable algorithm's estimate, in a fixed order (ties go to the first)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if message_bytes < 0:
        raise ValueError(f"message_bytes must be >= 0, got {message_bytes}")
    n = group.size
    if n == 1:
        return [CommEstimate(collective, "local", message_bytes, 1, 0.0)]
    if isinstance(group, TorusGroup):
        times = {"torus": _TORUS[collective](message_bytes, group)}
    else:
        if any(lv.collective_latency_s for lv in group.levels):
            levels = tuple(lv.for_collective(collective) for lv in group.levels)
            group = HierarchicalGroup(levels, group.ranks_per_domain)
        times = {
            name: fn(message_bytes, group)
            for name, table in _HIER_ALGORITHMS
            if (fn := table.get(collective)) is not None
        }
    return [
        CommEstimate(collective, name, message_bytes, n, t)
        for name, t in times.items()
        if t is not None
    ]


# ---------------------------------------------------------------- hierarchical levels


def _ring_bandwidth(g: HierarchicalGroup) -> float:
    parallel = (1,) + g.ranks_per_domain[:-1]
    return min(
        lv.efficiency * lv.bandwidth_bytes_per_s * k
        for lv, k in zip(g.levels, parallel, strict=True)
    )


def _top_latency(g: HierarchicalGroup) -> float:
    return g.levels[-1].latency_s


def _domains(g: HierarchicalGroup) -> list[int]:
    """D_l: how many level-l domains the group spans, for l = -1 .. L (D_{-1} = n, D_L = 1)."""
    n = g.size
    return [n] + [max(1, n // r) for r in g.ranks_per_domain]


def _ring_latency(g: HierarchicalGroup) -> float:
    d = _domains(g)
    return sum((d[i] - d[i + 1]) * lv.latency_s for i, lv in enumerate(g.levels))


def _tree_latency(g: HierarchicalGroup) -> float:
    below = (1,) + g.ranks_per_domain[:-1]
    chains = sum(
        (r // r_below - 1) * lv.latency_s
        for lv, r, r_below in zip(g.levels[:-1], g.ranks_per_domain[:-1], below[:-1], strict=True)
    )
    top_domains = g.size // below[-1]
    return chains + math.ceil(math.log2(max(top_domains, 1))) * _top_latency(g)


def _ring_all_reduce(s: float, g: HierarchicalGroup) -> float:
    n = g.size
    return 2 * _ring_latency(g) + 2 * (n - 1) / n * s / _ring_bandwidth(g)


def _ring_gather(s: float, g: HierarchicalGroup) -> float:
    n = g.size
    return _ring_latency(g) + (n - 1) / n * s / _ring_bandwidth(g)


def _ring_broadcast(s: float, g: HierarchicalGroup) -> float:
    return _ring_latency(g) + s / _ring_bandwidth(g)


def _tree_all_reduce(s: float, g: HierarchicalGroup) -> float:
    return 2 * _tree_latency(g) + 2 * s / _ring_bandwidth(g)


def _tree_broadcast(s: float, g: HierarchicalGroup) -> float:
    return _tree_latency(g) + s / _ring_bandwidth(g)


def _in_network_all_reduce(s: float, g: HierarchicalGroup) -> float | None:
    if any(lv.in_network_reduction_efficiency is None for lv in g.levels):
        return None
    parallel = (1,) + g.ranks_per_domain[:-1]
    bandwidth = min(
        lv.in_network_reduction_efficiency * lv.bandwidth_bytes_per_s * k  # type: ignore[operator]
        for lv, k in zip(g.levels, parallel, strict=True)
    )
    return 2 * _top_latency(g) + s / bandwidth


def _split(g: HierarchicalGroup) -> tuple[HierarchicalGroup, HierarchicalGroup] | None:
    """Inner group (one level-(L-1) domain) and outer group (one rank per domain)."""
    if len(g.levels) < 2:
        return None
    inner = HierarchicalGroup(g.levels[:-1], g.ranks_per_domain[:-1])
    outer_size = g.size // inner.size
    if outer_size < 2 or inner.size < 2:
        return None
    outer = HierarchicalGroup(g.levels[-1:], (outer_size,))
    return inner, outer


def _hier_all_reduce(s: float, g: HierarchicalGroup) -> float | None:
    parts = _split(g)
    if parts is None:
        return None
    inner, outer = parts
    return (
        collective_time("reduce_scatter", s, inner).time_s
        + collective_time("all_reduce", s / inner.size, outer).time_s
        + collective_time("all_gather", s, inner).time_s
    )


def _all_to_all(s: float, g: HierarchicalGroup) -> float:
    n = g.size
    below = (1,) + g.ranks_per_domain[:-1]
    transfer = max(
        (r - r_below) / n * s / (lv.efficiency * lv.bandwidth_bytes_per_s)
        for lv, r, r_below in zip(g.levels, g.ranks_per_domain, below, strict=True)
    )
    return (n - 1) * _top_latency(g) + transfer


def _send_recv(s: float, g: HierarchicalGroup) -> float:
    top = g.levels[-1]
    return top.latency_s + s / (top.efficiency * top.bandwidth_bytes_per_s)


# Algorithm registry: name -> {collective: cost function}; priced in this order.
_HIER_ALGORITHMS = (
    (
        "ring",
        {
            "all_reduce": _ring_all_reduce,
            "all_gather": _ring_gather,
            "reduce_scatter": _ring_gather,
            "broadcast": _ring_broadcast,
        },
    ),
    ("tree", {"all_reduce": _tree_all_reduce, "broadcast": _tree_broadcast}),
    ("in_network", {"all_reduce": _in_network_all_reduce}),
    (
        "hierarchical",
        {"all_reduce": _hier_all_reduce},
    ),
    ("pairwise", {"all_to_all": _all_to_all}),
    ("direct", {"send_recv": _send_recv}),
)


# ---------------------------------------------------------------- torus


def _torus_links(g: TorusGroup) -> float:
    t = g.torus
    directions = sum(2 if w else 1 for w in g.wraparound)
    return t.efficiency * t.link_bandwidth_bytes_per_s * directions


def _torus_hops_latency(g: TorusGroup) -> float:
    return sum(d - 1 for d in g.dim_sizes) * g.torus.latency_s


def _torus_gather(s: float, g: TorusGroup) -> float:
    n = g.size
    return _torus_hops_latency(g) + (n - 1) / n * s / _torus_links(g)


def _torus_all_reduce(s: float, g: TorusGroup) -> float:
    return 2 * _torus_gather(s, g)


def _torus_broadcast(s: float, g: TorusGroup) -> float:
    return _torus_hops_latency(g) + s / _torus_links(g)


def _torus_all_to_all(s: float, g: TorusGroup) -> float:
    t = g.torus
    link = t.efficiency * t.link_bandwidth_bytes_per_s
    transfer = sum(
        s * d / (4 * (2 if w else 1) * link)
        for d, w in zip(g.dim_sizes, g.wraparound, strict=True)
        if d > 1
    )
    return _torus_hops_latency(g) + transfer


def _torus_send_recv(s: float, g: TorusGroup) -> float:
    t = g.torus
    return t.latency_s + s / (t.efficiency * t.link_bandwidth_bytes_per_s)


_TORUS = {
    "all_reduce": _torus_all_reduce,
    "all_gather": _torus_gather,
    "reduce_scatter": _torus_gather,
    "all_to_all": _torus_all_to_all,
    "broadcast": _torus_broadcast,
    "send_recv": _torus_send_recv,
}


def ring_all_reduce_bytes_per_rank(message_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2(n-1)/n of the message."""
    return 2 * (n - 1) / n * message_bytes


# torch DDP's default gradient bucket (DistributedDataParallel bucket_cap_mb=25): the chunk
# autopar's runtime all-reduces a flat gradient buffer in (`flat_chunks`)
DDP_BUCKET_BYTES = 25 * 2**20


def flat_chunks(nbytes: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> list[float]:
    """The bytes of each all-reduce that sums a flat buffer of ``nbytes`` in chunks of at
    most ``bucket_bytes``, in order: all full but the last. autopar's runtime syncs its
    gradients so (`autopar.runtime.collectives.all_reduce_flat`: one chunk's copy held at a
    time), and the plan predicts its collectives by the same rule."""
    if nbytes <= 0:
        return []
    full = math.ceil(nbytes / bucket_bytes) - 1
    return [float(bucket_bytes)] * full + [float(nbytes - bucket_bytes * full)]
