"""Process groups of a config on the cluster, and their collective times (cached).

Ranks are laid out with tp innermost, then cp, fsdp, dp, and pp outermost (Megatron's and
torchtitan's default order), so tensor parallelism stays inside a node first. The group of an
axis is the ranks that differ only in that axis' coordinate, starting at rank 0; ep folds over
the innermost ep non-pipeline ranks; "world" is every rank.
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from cost_models.comm import collective_time


class MeshGroups:
    def __init__(self, cluster: Cluster, cfg: ParallelConfig) -> None:
        self.cluster = cluster
        strides = {"tp": 1}
        strides["cp"] = cfg.tp
        strides["fsdp"] = strides["cp"] * cfg.cp
        strides["dp"] = strides["fsdp"] * cfg.fsdp
        strides["pp"] = strides["dp"] * cfg.dp
        sizes = {"tp": cfg.tp, "cp": cfg.cp, "fsdp": cfg.fsdp, "dp": cfg.dp, "pp": cfg.pp}
        self.ranks = {axis: tuple(i * strides[axis] for i in range(sizes[axis])) for axis in sizes}
        self.ranks["ep"] = tuple(range(cfg.ep))
        self.ranks["world"] = tuple(range(cluster.world_size))
        # point-to-point partners: a pipeline neighbour, a context-parallel ring neighbour
        self.ranks["pp"] = self.ranks["pp"][:2]
        self.ranks["cp"] = self.ranks["cp"] if cfg.cp > 1 else (0,)
        self._groups = {axis: cluster.comm_group(r) for axis, r in self.ranks.items()}
        self._cp_pair = cluster.comm_group(self.ranks["cp"][:2])
        self._cache: dict[tuple[str, float, str], float] = {}

    def time(self, collective: str, nbytes: float, axis: str) -> float:
        """Seconds for ``collective`` of ``nbytes`` over the group of ``axis``."""
        key = (collective, nbytes, axis)
        cached = self._cache.get(key)
        if cached is None:
            group = (
                self._cp_pair
                if (axis == "cp" and collective == "send_recv")
                else self._groups[axis]
            )
            cached = collective_time(collective, nbytes, group).time_s  # type: ignore[arg-type]
            self._cache[key] = cached
        return cached
