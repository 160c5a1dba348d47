"""Cluster: a hardware profile times a number of nodes (or a TPU slice shape), on one site or
several.

In: a profile and its size. Out: a frozen `Cluster` that knows its world size, where each rank
sits (node and local index; torus coordinates on a TPU slice), and how any group of ranks lies
on the topology, as the `cost_models.comm` group types the collective estimates take.
Ranks are laid out node-major (rank r on node r // devices_per_node), and on a torus row-major
over the slice shape (the last dim varies fastest), as torchrun and the TPU runtime number them.

Sites: a cluster may span ``sites`` buildings or regions of equal size, ranks site-major, joined
by a wide-area link of ``site_link_gbps`` (each site's uplink, both directions) and
``site_latency_s``. The topology gains a level above the profile's scale-out network: that
network then spans one site, and the "sites" level the whole cluster, its bandwidth per device
the link divided among a site's devices (every data-parallel group crossing it at once shares
it, as all of a step's gradient sums do). A site is also a failure domain
(`autopar.estimate.algorithms`).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

from autopar.errors import ProfileError
from autopar.hardware.profile import HardwareProfile, load_profile
from cost_models.comm import (
    CommEstimate,
    Group,
    HierarchicalGroup,
    Level,
    TorusGroup,
    collective_time,
)

# the wide-area link's share of its nominal rate a collective reaches (TCP over long fat pipes,
# as NCCL's and gloo's sockets run there): an estimate, stated with the level
SITE_LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Cluster:
    profile: HardwareProfile
    num_nodes: int
    devices_per_node: int  # devices used per node (<= the profile's)
    slice_shape: tuple[int, ...] | None = None  # TPU slices only
    sites: int = 1  # buildings or regions of equal size, ranks site-major (module docstring)
    site_link_bytes_per_s: float = 0.0  # each site's wide-area uplink, per direction
    site_latency_s: float = 0.0

    @classmethod
    def from_profile(
        cls,
        name_or_path: str | Path,
        num_nodes: int = 1,
        *,
        devices_per_node: int | None = None,
        num_devices: int | None = None,
        slice_shape: Sequence[int] | None = None,
        sites: int = 1,
        site_link_gbps: float | None = None,
        site_latency_s: float = 0.01,
    ) -> Cluster:
        """A cluster of ``num_nodes`` nodes of a shipped profile (or a profile file).

        Args:
            name_or_path: a shipped profile name (see `shipped_profile_names`) or a .toml path.
            num_nodes: nodes of the profile's size.
            devices_per_node: use fewer devices per node than the profile has.
            num_devices: alternatively, the total device count: whole nodes, or part of one.
            slice_shape: TPU profiles: the slice, e.g. (4, 4, 4); required for them.
            sites: the nodes split over this many sites of equal size (module docstring).
            site_link_gbps: each site's wide-area uplink in Gb/s per direction; required
                with sites > 1.
            site_latency_s: one message's latency between sites (default 10 ms: about
                2,000 km of fiber, an assumption to set).

        Raises:
            ProfileError: the profile is unknown or malformed, or cannot form the cluster asked
                for (12 GPUs of 8-GPU nodes, a slice larger than the pod, ...).

        Example:
            >>> Cluster.from_profile("dgx_h100", num_nodes=2).world_size
            16
        """
        profile = load_profile(name_or_path)
        if profile.torus is not None:
            return cls._torus_cluster(profile, num_nodes, slice_shape, num_devices)
        if slice_shape is not None:
            raise ProfileError(f"{profile.name}: slice_shape is for TPU profiles only")
        per_node = profile.devices_per_node
        if num_devices is not None:
            num_nodes, devices_per_node = _split_devices(profile, num_devices)
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ProfileError(
                f"{profile.name}: num_nodes must be an integer >= 1, got {num_nodes}"
            )
        used = per_node if devices_per_node is None else devices_per_node
        if not 1 <= used <= per_node:
            raise ProfileError(
                f"{profile.name}: devices_per_node must be between 1 and {per_node} "
                f"(the profile's node), got {used}"
            )
        cluster = cls(_time_shared(profile, used), num_nodes, used)
        if sites == 1 and site_link_gbps is None:
            return cluster
        return cluster.over_sites(sites, site_link_gbps, site_latency_s)

    def over_sites(self, sites: int, link_gbps: float | None, latency_s: float) -> Cluster:
        """This cluster's nodes split over ``sites`` of equal size joined by a wide-area link
        (module docstring)."""
        name = self.profile.name
        if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
            raise ProfileError(f"{name}: sites must be an integer >= 1, got {sites!r}")
        if self.slice_shape is not None or self.sites > 1:
            raise ProfileError(f"{name}: sites are for node clusters of one site")
        if self.num_nodes % sites:
            raise ProfileError(
                f"{name}: {self.num_nodes} nodes do not split over {sites} sites of equal size"
            )
        if link_gbps is None or not link_gbps > 0 or not latency_s >= 0:
            raise ProfileError(
                f"{name}: {sites} sites need site_link_gbps > 0 (each site's wide-area "
                f"uplink) and site_latency_s >= 0, got {link_gbps!r} and {latency_s!r}"
            )
        per_site = self.num_nodes // sites * self.profile.devices_per_node  # physical
        link = link_gbps * 1e9 / 8
        levels = [*self.profile.levels]
        levels[-1] = replace(levels[-1], devices_per_domain=per_site)
        used = self.world_size // sites
        levels.append(Level("sites", 0, link / used, latency_s, SITE_LINK_EFFICIENCY))
        profile = replace(self.profile, levels=tuple(levels))
        return replace(
            self,
            profile=profile,
            sites=sites,
            site_link_bytes_per_s=link,
            site_latency_s=latency_s,
        )

    @property
    def site_terms(self) -> tuple[int, float, float]:
        """(sites, each site's link in Gb/s, latency in s): (1, 0, 0) for one site."""
        return self.sites, self.site_link_bytes_per_s * 8 / 1e9, self.site_latency_s

    def one_site(self) -> Cluster:
        """One site of this cluster, alone: what a replica group of a cross-site algorithm
        runs on (itself when there is one site)."""
        if self.sites == 1:
            return self
        levels = (*self.profile.levels[:-2], replace(self.profile.levels[-2], devices_per_domain=0))
        return replace(
            self,
            profile=replace(self.profile, levels=levels),
            num_nodes=self.num_nodes // self.sites,
            sites=1,
            site_link_bytes_per_s=0.0,
            site_latency_s=0.0,
        )

    def site_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // (self.world_size // self.sites)

    @classmethod
    def _torus_cluster(
        cls,
        profile: HardwareProfile,
        num_nodes: int,
        slice_shape: Sequence[int] | None,
        num_devices: int | None,
    ) -> Cluster:
        torus = profile.torus
        assert torus is not None
        if slice_shape is None:
            example = "x".join(str(min(4, d)) for d in torus.max_shape)
            raise ProfileError(
                f"{profile.name} is a TPU torus: give slice_shape with {torus.num_dims} dims "
                f"(e.g. {example}), up to {'x'.join(map(str, torus.max_shape))}"
            )
        shape = tuple(slice_shape)
        if (
            len(shape) != torus.num_dims
            or any(not isinstance(d, int) or d < 1 for d in shape)
            or any(d > m for d, m in zip(shape, torus.max_shape, strict=True))
        ):
            raise ProfileError(
                f"{profile.name}: slice_shape {shape} must have {torus.num_dims} positive dims "
                f"no larger than {torus.max_shape}"
            )
        chips = math.prod(shape)
        if num_devices is not None and num_devices != chips:
            raise ProfileError(
                f"{profile.name}: num_devices={num_devices} but slice {shape} has {chips}"
            )
        hosts = max(1, chips // profile.devices_per_node)
        return cls(profile, hosts, min(chips, profile.devices_per_node), shape)

    # ------------------------------------------------------------------ layout

    @property
    def world_size(self) -> int:
        if self.slice_shape is not None:
            return math.prod(self.slice_shape)
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.devices_per_node

    @property
    def compute_share(self) -> float:
        """The share of a compute slot each device gets when all of a node's devices compute
        at once (`_time_shared` priced the profile at it): 1 unless ranks outnumber slots."""
        slots = self.profile.compute_slots
        if self.slice_shape is not None or not slots or self.devices_per_node <= slots:
            return 1.0
        return slots / self.devices_per_node

    @property
    def straggler_share(self) -> float:
        """How much longer than its typical device a synchronous step takes: it runs at the
        pace of its slowest of ``world_size`` devices, whose speeds spread by the profile's
        ``speed_spread`` (a relative standard deviation). The slowest of n normal draws sits
        about Phi^-1((n - 0.375) / (n + 0.25)) deviations out (Blom's approximation of the
        expected maximum: 4.5% over the exact value at n = 2, within 1% from n = 8 to 10^5;
        the standard library's inverse normal, since none of the dependencies has the exact
        order statistic): 1.43 at 8 devices, 2.58 at 128, 3.43 at 2,048."""
        n, spread = self.world_size, self.profile.speed_spread
        if n < 2 or not spread:
            return 0.0
        return spread * NormalDist().inv_cdf((n - 0.375) / (n + 0.25))

    def pipeline_placement(self, pp: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Per pipeline rank (pp is the outermost axis): the node it sits on and the devices it
        stands for there. A stage that spans nodes stands for a whole node of its own."""
        per_stage = self.world_size // pp
        if per_stage <= self.devices_per_node:
            return tuple(s * per_stage // self.devices_per_node for s in range(pp)), (
                float(per_stage),
            ) * pp
        return tuple(range(pp)), (float(self.devices_per_node),) * pp

    def torus_coords(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        assert self.slice_shape is not None, "torus_coords is for TPU slices"
        coords = []
        for size in reversed(self.slice_shape):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the cluster's world of {self.world_size}")

    def _physical_index(self, rank: int) -> int:
        # Device position within the profile's full nodes, so that a partly used node still
        # maps its devices onto the right inner domains.
        node, local = divmod(rank, self.devices_per_node)
        return node * self.profile.devices_per_node + local

    # ------------------------------------------------------------------ groups

    def comm_group(self, ranks: Sequence[int]) -> Group:
        """How ``ranks`` lie on the topology, for `cost_models.comm.collective_time`."""
        ranks = sorted(set(ranks))
        if not ranks:
            raise ValueError("a communication group needs at least one rank")
        for r in ranks:
            self._check_rank(r)
        if self.slice_shape is not None:
            return self._torus_group(ranks)
        levels = self.profile.levels
        per_level: list[int] = []
        for depth, level in enumerate(levels):
            size = level.devices_per_domain
            domains = Counter(0 if size == 0 else self._physical_index(r) // size for r in ranks)
            # The bottleneck is the least populated domain (fewest parallel links out of it).
            per_level.append(min(domains.values()))
            if len(domains) == 1:
                return HierarchicalGroup(levels[: depth + 1], tuple(per_level))
        raise AssertionError("the outermost level spans the cluster")  # checked on load

    def _torus_group(self, ranks: list[int]) -> TorusGroup:
        assert self.profile.torus is not None and self.slice_shape is not None
        coords = [self.torus_coords(r) for r in ranks]
        sizes, wraps = [], []
        for dim, full in enumerate(self.slice_shape):
            distinct = len({c[dim] for c in coords})
            if distinct > 1:
                sizes.append(distinct)
                # wraparound links close the ring only when the group spans the whole dim
                wraps.append(distinct == full and full >= self.profile.torus.wraparound_min_size)
        if not sizes:
            sizes, wraps = [1], [False]
        return TorusGroup(self.profile.torus, tuple(sizes), tuple(wraps))

    def level_of(self, ranks: Sequence[int]) -> str:
        """Name of the outermost topology level the group communicates over."""
        group = self.comm_group(ranks)
        if isinstance(group, TorusGroup):
            return "ici"
        return group.levels[-1].name

    def collective_time(
        self, collective: str, message_bytes: float, ranks: Sequence[int]
    ) -> CommEstimate:
        """Shorthand for the cheapest estimate of a collective over ``ranks`` on this cluster."""
        return collective_time(collective, message_bytes, self.comm_group(ranks))  # type: ignore[arg-type]

    def as_text(self) -> str:
        if self.slice_shape is not None:
            head = (
                f"{self.profile.name}: slice {'x'.join(map(str, self.slice_shape))} = "
                f"{self.world_size} chips on {self.num_nodes} hosts"
            )
        else:
            partial = (
                ""
                if self.devices_per_node == self.profile.devices_per_node
                else f" (of {self.profile.devices_per_node})"
            )
            head = (
                f"{self.profile.name}: {self.num_nodes} node(s) x {self.devices_per_node} "
                f"devices{partial} = world size {self.world_size}"
            )
        if self.sites > 1:
            head += (
                f", over {self.sites} sites joined by {self.site_link_bytes_per_s * 8 / 1e9:g} "
                f"Gb/s each ({self.site_latency_s * 1e3:g} ms)"
            )
        return head + "\n" + self.profile.as_text()


def cluster_fingerprint(
    profile_name: str,
    num_nodes: int,
    devices_per_node: int,
    sites: tuple[int, float, float] = (1, 0.0, 0.0),
) -> str:
    """16 hex digits naming a cluster's profile and size, and for a cluster of several sites
    ``sites`` = (sites, link Gb/s, latency s): what a plan records of the cluster it was
    priced on, checked when the plan file is read (`autopar.plan.check`). One site's is what
    it was before sites existed."""
    where = f"{profile_name}|{num_nodes}|{devices_per_node}|{num_nodes * devices_per_node}"
    if sites[0] > 1:
        where += "|sites|{}|{:.6g}|{:.6g}".format(*sites)
    return hashlib.sha256(where.encode()).hexdigest()[:16]


def _time_shared(profile: HardwareProfile, used: int) -> HardwareProfile:
    """The profile as ``used`` devices per node see it when only ``profile.compute_slots`` of
    them compute at once (ranks on fewer CPU cores): the operating system gives each device
    slots / used of the time, so its FLOP/s, memory and collective bandwidths scale by that
    share and its per-op, per-layer and collective latencies by the inverse. Unchanged when
    the slots suffice (every GPU profile)."""
    slots = profile.compute_slots
    if not slots or used <= slots:
        return profile
    share = slots / used
    d = profile.device
    device = replace(
        d,
        name=f"{d.name}, {used} sharing {slots} slots",
        peak_flops_per_s={k: v * share for k, v in d.peak_flops_per_s.items()},
        memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s * share,
        launch_overhead_s=d.launch_overhead_s / share,
    )

    def slower(overheads: Mapping[str, float]) -> dict[str, float]:
        return {k: v / share for k, v in overheads.items()}

    # the collectives run on the same cores (gloo copies, reduces and moves loopback bytes
    # through the kernel on the ranks' own threads): their rate scales by the share too, and
    # each step's latency (a peer's wake-up) by its inverse
    levels = tuple(
        replace(
            lv,
            bandwidth_bytes_per_s=lv.bandwidth_bytes_per_s * share,
            latency_s=lv.latency_s / share,
            collective_latency_s=tuple((k, v / share) for k, v in lv.collective_latency_s),
        )
        for lv in profile.levels
    )
    return replace(
        profile,
        device=device,
        levels=levels,
        runtime_overhead_s=slower(profile.runtime_overhead_s),
        optimizer_overhead_s=slower(profile.optimizer_overhead_s),
        model_overhead_s=slower(profile.model_overhead_s),
    )


def _split_devices(profile: HardwareProfile, num_devices: int) -> tuple[int, int]:
    per_node = profile.devices_per_node
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ProfileError(
            f"{profile.name}: num_devices must be an integer >= 1, got {num_devices}"
        )
    if num_devices <= per_node:
        return 1, num_devices
    if num_devices % per_node:
        lower = num_devices // per_node * per_node
        raise ProfileError(
            f"{profile.name}: cannot form a world of {num_devices} devices from nodes of "
            f"{per_node}: use at most {per_node} on one node or a multiple of {per_node} "
            f"(e.g. {lower} or {lower + per_node})"
        )
    return num_devices // per_node, per_node


def priced_sites(training: Mapping[str, Any] | None, own: bool) -> tuple[int, float, float]:
    """(sites, link Gb/s, latency s) of the cluster a plan's training record was priced on:
    the whole cluster's, or with ``own`` the plan's own cluster's -- one site for a DiLoCo
    plan, which is one site's group. (1, 0, 0) without a record or sites, and for a record
    written before the latency was kept (its fingerprint did not count the sites)."""
    if not training or training.get("sites", 1) <= 1 or "site_latency_s" not in training:
        return 1, 0.0, 0.0
    if own and training.get("chosen", {}).get("name") == "diloco":
        return 1, 0.0, 0.0
    return int(training["sites"]), training["site_link_gbps"], training["site_latency_s"]
