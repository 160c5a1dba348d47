"""How a config's mesh axes lie on the cluster's topology, as plain data for the plan.

In: a `Cluster` and a `ParallelConfig`. Out: one `dict` per mesh axis of size > 1 (JSON values
only, so a `Plan` carries it): the axis, its size, the ranks of its group that starts at rank 0,
the outermost topology level those ranks talk over (`Cluster.level_of`), that level's bandwidth
and how many nodes the group spans.

The groups are the cost model's own (`autopar.estimate.mesh.MeshGroups`: the config's axis
order, by default tp innermost, then cp, fsdp, dp, pp outermost), so the text says where the
priced collectives run; for pp the group is two neighbouring stages, the hop whose link is
the outermost level (`MeshGroups.outermost_hop`; each hop is priced on its own link).
"""

from __future__ import annotations

from typing import Any

from autopar.config import ParallelConfig
from autopar.estimate.mesh import MeshGroups
from autopar.hardware import Cluster

AXES = ("tp", "cp", "ep", "fsdp", "dp", "pp")


def mesh_axes(cluster: Cluster, config: ParallelConfig) -> tuple[dict[str, Any], ...]:
    """Per mesh axis of size > 1: where its group runs on ``cluster`` (module docstring)."""
    groups = MeshGroups(cluster, config)
    out: list[dict[str, Any]] = []
    for axis in AXES:
        size = getattr(config, axis)
        if size <= 1:
            continue
        ranks = groups.outermost_hop() if axis == "pp" else groups.ranks[axis]
        entry: dict[str, Any] = {
            "axis": axis,
            "size": size,
            "ranks": list(ranks),
            "level": cluster.level_of(ranks),
            "num_nodes": len({cluster.node_of(r) for r in ranks}),
        }
        entry.update(_level_facts(cluster, entry["level"]))
        out.append(entry)
    return tuple(out)


def _level_facts(cluster: Cluster, level_name: str) -> dict[str, Any]:
    if cluster.profile.torus is not None:
        torus = cluster.profile.torus
        return {"bandwidth_bytes_per_s": torus.link_bandwidth_bytes_per_s, "domain_devices": 0}
    for level in cluster.profile.levels:
        if level.name == level_name:
            return {
                "bandwidth_bytes_per_s": level.bandwidth_bytes_per_s,
                "domain_devices": level.devices_per_domain,
            }
    raise AssertionError(f"level {level_name!r} is not in {cluster.profile.name}")
