"""Process groups of a config on the cluster, and their collective times (cached).

In: a `Cluster` and a `ParallelConfig`. Out: `MeshGroups`, the ranks of each axis' group that
holds rank 0 and the seconds of a collective over it.

Layout: the non-pipeline axes lie on the ranks in the config's `axis_order`, innermost (stride
1) first, pp outermost; the default is tp, cp, fsdp, dp (Megatron's and torchtitan's order, tensor
parallelism inside a node first). An axis' coordinate is rank // stride % degree
(`ParallelConfig.strides`), and its group is the ranks that differ only in that coordinate,
starting at rank 0. `autopar.runtime.mesh.build_mesh` lays the DeviceMesh out the same way.

Expert parallelism: where the runtime can run it (ep divides dp x fsdp x cp) ep folds over the
ranks holding different tokens (index (dp * fsdp + fsdp) * cp + cp, cp inner), the ep of them
nearest rank 0, as
`autopar.runtime.expert_parallel.build_expert_groups` builds the groups; otherwise
(`ParallelConfig.ep_folds_over_tp`) over the innermost ep non-pipeline ranks and the experts'
replicas every ep-th rank (Megatron-Core's fold; the runtime refuses those configs).
"world" is every rank.

`layout_signature` is what the cost model sees of a layout: two configs with equal signatures
price every collective alike, so the search keeps one axis order per signature.
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.hardware import Cluster
from cost_models.comm import collective_time


def axis_ranks(cfg: ParallelConfig) -> dict[str, tuple[int, ...]]:
    """Per axis (dp, fsdp, cp, tp, pp, ep, expert_dp, fsdp_cp), the ranks of its group that holds
    rank 0."""
    strides = cfg.strides
    out = {
        axis: tuple(i * strides[axis] for i in range(getattr(cfg, axis)))
        for axis in ("tp", "cp", "fsdp", "dp", "pp")
    }
    out["ep"] = expert_ranks(cfg)
    out["expert_dp"] = expert_data_ranks(cfg)
    # FSDP over the fsdp and cp ranks together (CostOptions.fsdp_over_cp)
    out["fsdp_cp"] = tuple(sorted(f + c for f in out["fsdp"] for c in out["cp"]))
    return out


def _token_rank(cfg: ParallelConfig, i: int) -> int:
    """The global rank of token index ``i`` (dp outer, fsdp, cp inner: the ranks holding
    different tokens) on rank 0's stage."""
    strides = cfg.strides
    data, c = divmod(i, cfg.cp)
    return data // cfg.fsdp * strides["dp"] + data % cfg.fsdp * strides["fsdp"] + c * strides["cp"]


def expert_data_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """The ranks holding rank 0's experts (dp x fsdp x cp / ep of the token ranks, every
    ep-th: the expert data group `build_expert_groups` builds), where the experts' gradients
    are summed."""
    tokens = cfg.dp * cfg.fsdp * cfg.cp
    if cfg.ep_folds_over_tp:  # ep innermost over the stage's ranks, its replicas outside
        return tuple(j * cfg.ep for j in range(tokens * cfg.tp // cfg.ep))
    if cfg.ep == 1 or tokens % cfg.ep:
        return (0,)
    return tuple(_token_rank(cfg, j * cfg.ep) for j in range(tokens // cfg.ep))


def expert_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """The ep group that holds rank 0 (module docstring: folded over the token ranks)."""
    if (cfg.dp * cfg.fsdp * cfg.cp) % cfg.ep == 0:
        return tuple(_token_rank(cfg, i) for i in range(cfg.ep))
    return tuple(range(cfg.ep))


class MeshGroups:
    def __init__(
        self, cluster: Cluster, cfg: ParallelConfig, stage_ranks: tuple[int, ...] | None = None
    ) -> None:
        """``stage_ranks``: each pipeline stage's first rank where the stages are not laid out
        as ``cfg``'s pp axis (stages of meshes of their own, `autopar.estimate.staged`)."""
        self.cluster = cluster
        self.ranks = _priced_ranks(cluster, cfg, stage_ranks)
        self.ranks["world"] = tuple(range(cluster.world_size))
        self._groups = {axis: cluster.comm_group(r) for axis, r in self.ranks.items()}
        self._cache: dict[tuple[str, float, str], float] = {}
        self._hop_axes = [axis for axis in self.ranks if axis.startswith("pp_hop")]

    def hop_times(self, collective: str, nbytes: float) -> tuple[float, ...]:
        """Seconds for ``collective`` of ``nbytes`` over each pipeline hop (`_hops`)."""
        return tuple(self.time(collective, nbytes, axis) for axis in self._hop_axes)

    def outermost_hop(self) -> tuple[int, ...]:
        """The pipeline hop whose link is the outermost level, the first such; on a TPU slice,
        whose hops are priced alike, the first. The hop back from the last stage to the first
        is left out: its ranks are at most as far apart as the farthest forward hop (the
        levels nest), so it is never the only one that deep."""
        deepest = max(
            self._hop_axes[:-1], key=lambda a: len(getattr(self._groups[a], "levels", ()))
        )
        return self.ranks[deepest]

    def time(self, collective: str, nbytes: float, axis: str) -> float:
        """Seconds for ``collective`` of ``nbytes`` over the group of ``axis``."""
        key = (collective, nbytes, axis)
        cached = self._cache.get(key)
        if cached is None:
            ring_step = axis == "cp" and collective == "send_recv"
            group = self._groups["cp_pair" if ring_step else axis]
            cached = collective_time(collective, nbytes, group).time_s  # type: ignore[arg-type]
            self._cache[key] = cached
        return cached


def _hops(cluster: Cluster, stages: tuple[int, ...]) -> list[tuple[int, int]]:
    """Per pipeline rank s, its stage's first rank and the next one's: the hop a send between
    ranks s and s + 1 takes (the last: back to the first stage, which interleaved and V
    schedules cross). On a TPU slice every hop is priced as the first (neighbours on the
    torus)."""
    n = len(stages)
    if n < 2:
        return []
    if cluster.slice_shape is not None:
        return [(stages[0], stages[1])] * n
    return [(stages[s], stages[(s + 1) % n]) for s in range(n)]


def layout_signature(cluster: Cluster, cfg: ParallelConfig) -> tuple:
    """How every priced group of ``cfg`` lies on ``cluster``'s levels (the world group is the
    same for every layout and left out): equal signatures, equal collective times."""
    ranks = _priced_ranks(cluster, cfg)
    return tuple(cluster.comm_group(ranks[a]) for a in sorted(ranks))


def _priced_ranks(
    cluster: Cluster, cfg: ParallelConfig, stage_ranks: tuple[int, ...] | None = None
) -> dict[str, tuple[int, ...]]:
    """`axis_ranks` with the point-to-point partners the cost model prices: each pipeline
    hop (``pp_hop{s}``, `_hops`: the timer prices each on its own link), the first and last
    stages (tied weights), and a context-parallel ring step. ``stage_ranks`` as for
    `MeshGroups`."""
    ranks = axis_ranks(cfg)
    pp = stage_ranks if stage_ranks is not None else ranks["pp"]
    ranks.update({f"pp_hop{s}": pair for s, pair in enumerate(_hops(cluster, pp))})
    ranks["pp_ends"] = (pp[0], pp[-1])
    ranks["cp_pair"] = ranks["cp"][:2]
    return ranks
