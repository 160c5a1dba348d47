"""The training algorithm as a priced choice: synchronous, fault-tolerant replica groups, DiLoCo.

In: the synchronous plan's figures (step time, the bytes its collectives move across sites,
its checkpoint-restart goodput), for DiLoCo the plan of one replica group (one site, the
global batch divided among the sites), the model's parameter count, the cluster and its
`Reliability`, and `AlgorithmOptions` (the token budget, the inner steps and fragments to
try, the convergence assumption). Out: one `AlgorithmEstimate` per candidate; `choose` takes
the one that reaches the token budget first.

    sync        every step sums the gradients over all ranks; a failure stops every rank, and
                the job restarts from its last checkpoint (`estimate.goodput`: Daly's model,
                the checkpoint interval chosen).
    ft          the same steps, the data-parallel ranks split into M replica groups that fail
                alone (torchft's Manager and quorum; HSDP with the groups on the replicate
                axis): a failure costs the step in flight, which every group discards, and
                the failed group's absence -- its restart R, its rejoining J (its first quorum
                and the heal's set-up, `Reliability.rejoin_s`) and its heal, copying the state
                S from a healthy peer over the slowest link between groups -- while the other
                M - 1 keep stepping; before they drop that step they wait out the collective
                timeout D (`AlgorithmOptions.ft_timeout_s`, the runtime's
                `FTGroup.timeout_s`): waste per failure D + T + (R + J + S / link) / M.
                Each step also pays torchft's own work (`ft_step_cost`): the gradients'
                all-reduce over the groups, which the runtime runs after the backward in
                the flat chunks of its other gradient syncs (`flat_chunks`; what the
                synchronous plan hid of its gradient sync behind the backward is exposed
                now; what it already exposed is not paid twice), and the quorum and commit
                RPCs (`Reliability.ft_control_s`).
    diloco      M replica groups (one per site) each take H inner steps of their own plan
                (the global batch / M each) and then all-reduce a pseudo-gradient, the
                parameters' change since the last outer step (P x b_outer bytes, fp32 by
                default), through an outer Nesterov step (Douillard et al. 2023,
                arXiv:2311.08105). The outer all-reduce takes
                t_o = 2 (M - 1) / M x P x b_outer / (link x efficiency) + 2 (M - 1) latency;
                blocking (one fragment) it adds t_o / H to each step; streaming (F > 1
                fragments, each synced in turn while the inner steps go on: Douillard et al.
                2025, arXiv:2501.18512) only what the H inner steps do not cover,
                max(0, t_o - H x T) / H. Every outer step takes every group (the runtime's
                Manager asks for all M), so a failure stops them all at the next fragment
                sync until the failed group is back: it restarts (R), resumes from its
                checkpoint and redoes its steps since the last sync (H / (2F) on average)
                while the others finish theirs, and rejoins and is healed there (J + S / link,
                a peer's model, optimizer and outer state, `runtime.diloco.Position`, where
                its checkpoint is older): waste per failure R + H T / (2F) + J + S / link,
                for the whole job, not one group's share.

Cross-site bytes are per site and direction, per step: for sync and ft what the plan's
collectives over axes that span sites move through a site's uplink (a ring's
2 (M - 1) / M of an all-reduce's buffer, (M - 1) / M of a gather's, each pipeline send
across a site boundary whole), summed over the groups; for DiLoCo the outer all-reduce's
2 (M - 1) / M x P x b_outer divided by H, each parameter once (one copy of each shard sent;
the synchronous sum over tp ranks also moves the replicated norms once per tp rank, as the
runtime sums them). With fp32 gradients and b_outer = 4 the DiLoCo figure is then the
synchronous gradient sum's divided by H exactly (tests/autopar/estimate/test_algorithms.py).

Convergence: local steps are not free. DiLoCo is assumed to need (1 + token_overhead) times
the tokens of synchronous training to reach its loss. This is an assumption the user sets
(`AlgorithmOptions.diloco_token_overhead`), stated in the plan and explain(); its default,
5%, is a margin over the published results: DiLoCo on 8 replicas with H = 500 matched
synchronous training's perplexity (Douillard et al. 2023), and in the scaling-law study of
Charles et al. 2025 (arXiv:2503.09799) the gap between DiLoCo with 2 replicas and data-
parallel training shrinks with model size and is within a few percent of loss at the
largest sizes studied (2.4B, extrapolated to 10B). Synchronous and ft training take the
same steps, so theirs is 1.

Time to the token budget: budget / tokens per step x step time x token multiplier /
goodput. The budget defaults to 20 tokens a parameter (Hoffmann et al. 2022), stated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.config import ParallelConfig
from autopar.estimate.goodput import STATE_BYTES_PER_PARAM
from autopar.estimate.mesh import MeshGroups, axis_ranks
from autopar.hardware import Cluster, Reliability
from cost_models.comm import flat_chunks

CONVERGENCE_SOURCE = (
    "assumed: DiLoCo needs {pct:.0%} more tokens than synchronous training to reach its loss "
    "(AlgorithmOptions.diloco_token_overhead; a margin over Douillard et al. 2023, "
    "arXiv:2311.08105, and Charles et al. 2025, arXiv:2503.09799)"
)
TOKENS_PER_PARAM = 20.0  # the default budget: Hoffmann et al. 2022's compute-optimal ratio


@dataclass(frozen=True)
class AlgorithmOptions:
    """Which training algorithms `parallelize` prices, and the assumptions it prices them
    under (module docstring)."""

    # "auto": price every algorithm the cluster offers and take the fastest to the budget;
    # or one of "sync", "ft", "diloco" to price that one only (it is taken where it applies)
    choose: str = "auto"
    token_budget: float | None = None  # tokens; None: TOKENS_PER_PARAM a parameter
    inner_steps: tuple[int, ...] = (8, 32, 128, 512)  # DiLoCo's H, searched
    fragments: tuple[int, ...] = (1, 4)  # 1: blocking outer steps; F > 1: streaming
    diloco_token_overhead: float = 0.05  # the convergence assumption (module docstring)
    outer_bytes_per_param: float = 4.0  # the pseudo-gradient's element bytes (fp32)
    # fault-tolerant groups: how long the survivors wait on a dead group's collective before
    # dropping the step (`runtime.fault_tolerance.FTGroup.timeout_s`, the same default)
    ft_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.choose not in ("auto", "sync", "ft", "diloco"):
            raise ValueError(f"choose must be auto, sync, ft or diloco, got {self.choose!r}")
        if self.token_budget is not None and not self.token_budget > 0:
            raise ValueError(f"token_budget must be > 0 tokens, got {self.token_budget!r}")
        if not self.inner_steps or any(h < 1 for h in self.inner_steps):
            raise ValueError(f"inner_steps must be whole numbers >= 1, got {self.inner_steps}")
        if not self.fragments or any(f < 1 for f in self.fragments):
            raise ValueError(f"fragments must be whole numbers >= 1, got {self.fragments}")
        if not 0 <= self.diloco_token_overhead < 10:
            raise ValueError(
                f"diloco_token_overhead must be in [0, 10), got {self.diloco_token_overhead}"
            )
        if not self.outer_bytes_per_param > 0:
            raise ValueError("outer_bytes_per_param must be > 0")


@dataclass(frozen=True)
class AlgorithmEstimate:
    name: str  # "sync", "ft", "diloco"
    replicas: int  # M: replica groups (1 for sync)
    inner_steps: int  # H (1 but for DiLoCo)
    fragments: int  # F (1 but for streaming DiLoCo)
    config: str  # the parallel config each replica group (or the whole job) runs
    step_time_s: float  # per step of the whole job's tokens, outer steps amortised
    cross_site_bytes_per_step: float  # per site and direction (module docstring)
    goodput: float
    token_multiplier: float
    time_to_budget_s: float
    detail: str = ""  # how the step and goodput were priced, in one line
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def token_budget(options: AlgorithmOptions, num_params: float) -> float:
    return options.token_budget or TOKENS_PER_PARAM * num_params


def cross_site_bytes(
    communication: tuple[tuple[dict[str, Any], ...], ...], cfg: ParallelConfig, cluster: Cluster
) -> float:
    """What one step's collectives move through one site's uplink in one direction (module
    docstring): per stage, every collective over an axis whose groups span sites, times the
    number of such groups on the stage, times the ring's share; pipeline sends between stages
    on different sites whole."""
    if cluster.sites == 1:
        return 0.0
    ranks = axis_ranks(cfg)
    share = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
    total = 0.0
    stage_ranks = cluster.world_size // cfg.pp
    stage_site = [cluster.site_of(s * stage_ranks) for s in range(cfg.pp)]
    cuts: dict[str, list[tuple[int, float]]] = {}
    for stage, collectives in enumerate(communication):
        for c in collectives:
            if c["part"] == "pp" and c["kind"] == "send":
                cuts.setdefault(c["layer"], []).append((stage, c["count"] * c["bytes"]))
                continue
            group = ranks.get(c["axis"], tuple(range(cluster.world_size)))
            sites = len({cluster.site_of(r) for r in group})
            if sites == 1 or c["kind"] not in share:
                continue
            groups = stage_ranks / len(group)  # this stage's groups, all crossing at once
            ring = share[c["kind"]] * (sites - 1) / sites
            total += groups * c["count"] * c["bytes"] * ring
    for sends in cuts.values():  # a cut's two stages: activations down, gradients up
        stages = {s for s, _ in sends}
        if len({stage_site[s] for s in stages}) > 1:
            total += max(b for _, b in sends) * stage_ranks
    return total


def outer_allreduce_s(num_params: float, cluster: Cluster, options: AlgorithmOptions) -> float:
    """One DiLoCo outer step's all-reduce of the pseudo-gradient over the sites' link."""
    m = cluster.sites
    link = cluster.site_link_bytes_per_s * cluster.profile.levels[-1].efficiency
    ring = 2 * (m - 1) / m
    return ring * num_params * options.outer_bytes_per_param / link + 2 * (m - 1) * (
        cluster.site_latency_s
    )


def _heal_s(num_params: float, optimizer: str, link_bytes_per_s: float) -> float:
    """Copying a replica group's state (weights and optimizer state) from a healthy peer."""
    return num_params * STATE_BYTES_PER_PARAM[optimizer] / link_bytes_per_s


def ft_step_cost(
    cfg: ParallelConfig,
    cluster: Cluster,
    grad_bytes: float,
    exposed_sync_s: float,
    control_s: float,
) -> tuple[float, float]:
    """(seconds torchft adds to a synchronous step, of which the gradient all-reduce): the
    all-reduce of a rank's ``grad_bytes`` of gradient shards over the groups (the plan's dp
    axis) in the runtime's flat chunks, less the ``exposed_sync_s`` the synchronous step
    already paid for its gradient sync, plus ``control_s`` (module docstring)."""
    mesh = MeshGroups(cluster, cfg)
    reduce = sum(mesh.time("all_reduce", chunk, "dp") for chunk in flat_chunks(grad_bytes))
    return max(0.0, reduce - exposed_sync_s) + control_s, reduce


def _failure_waste(rate_per_s: float, per_failure_s: float) -> float:
    return min(1.0, rate_per_s * per_failure_s)


def price_sync(
    step_time_s: float,
    cfg: ParallelConfig,
    tokens_per_step: float,
    cross_bytes: float,
    goodput: float,
    budget: float,
) -> AlgorithmEstimate:
    steps = budget / tokens_per_step
    return AlgorithmEstimate(
        "sync", 1, 1, 1, cfg.as_text(), step_time_s, cross_bytes, goodput, 1.0,
        steps * step_time_s / goodput,
        "every step sums the gradients over all ranks; a failure restarts the job from "
        "its last checkpoint",
    )  # fmt: skip


def price_ft(
    step_time_s: float,
    cfg: ParallelConfig,
    tokens_per_step: float,
    cross_bytes: float,
    budget: float,
    cluster: Cluster,
    reliability: Reliability,
    num_params: float,
    optimizer: str,
    replicas: int,
    timeout_s: float = 30.0,
    step_cost_s: float = 0.0,
) -> AlgorithmEstimate:
    """Synchronous steps over ``replicas`` fault-tolerant replica groups (module docstring);
    ``step_cost_s``: what torchft adds to each step (`ft_step_cost`)."""
    rate = cluster.world_size * reliability.failure_rate_per_device_hour / 3600.0
    link = _group_link(cluster, replicas)
    heal = _heal_s(num_params, optimizer, link)
    step = step_time_s + step_cost_s
    lost = timeout_s + step + (reliability.restart_s + reliability.rejoin_s + heal) / replicas
    waste = _failure_waste(rate, lost)
    good = 1.0 - waste
    steps = budget / tokens_per_step
    rejoin = f", {reliability.rejoin_s:.1f} s more to rejoin" if reliability.rejoin_s else ""
    return AlgorithmEstimate(
        "ft", replicas, 1, 1, cfg.as_text(), step, cross_bytes, good, 1.0,
        steps * step / max(good, 1e-9),
        f"a failed group of {replicas} restarts ({reliability.restart_s:.0f} s{rejoin}) and "
        f"heals from a peer ({heal:.0f} s) while the others step; they lose the step in "
        f"flight and the {timeout_s:.0f} s timeout that drops it; torchft adds "
        f"{step_cost_s * 1e3:.1f} ms a step (quorum, commit, the gradient all-reduce after "
        "the backward)",
        {"heal_s": heal, "torchft_step_s": step_cost_s},
    )  # fmt: skip


def price_diloco(
    inner_step_s: float,
    site_cfg: ParallelConfig,
    tokens_per_step: float,
    budget: float,
    cluster: Cluster,
    reliability: Reliability | None,
    num_params: float,
    optimizer: str,
    options: AlgorithmOptions,
    inner_steps: int,
    fragments: int,
) -> AlgorithmEstimate:
    """DiLoCo over the cluster's sites, one replica group each (module docstring)."""
    m, h = cluster.sites, inner_steps
    outer = outer_allreduce_s(num_params, cluster, options)
    exposed = outer if fragments == 1 else max(0.0, outer - h * inner_step_s)
    step = inner_step_s + exposed / h
    ring = 2 * (m - 1) / m
    cross = ring * num_params * options.outer_bytes_per_param / h
    good = 1.0
    heal = 0.0
    if reliability is not None:
        rate = cluster.world_size * reliability.failure_rate_per_device_hour / 3600.0
        heal = _heal_s(num_params, optimizer, _group_link(cluster, m))
        redo = h * inner_step_s / (2 * fragments)
        lost = reliability.restart_s + redo + reliability.rejoin_s + heal
        good = 1.0 - _failure_waste(rate, lost)  # the others wait for it (module docstring)
    multiplier = 1.0 + options.diloco_token_overhead
    steps = budget / tokens_per_step
    how = "blocking" if fragments == 1 else f"streaming in {fragments} fragments"
    return AlgorithmEstimate(
        "diloco", m, h, fragments, site_cfg.as_text(), step, cross, good, multiplier,
        steps * step * multiplier / max(good, 1e-9),
        f"{m} groups of {cluster.world_size // m} take {h} inner steps, then all-reduce the "
        f"pseudo-gradient over the sites in {outer:.1f} s ({how}: {exposed / h:.2f} s a step)",
        {"outer_allreduce_s": outer, "inner_step_s": inner_step_s, "heal_s": heal},
    )  # fmt: skip


def _group_link(cluster: Cluster, replicas: int) -> float:
    """The bandwidth a healing group copies its state at: the sites' link where the groups
    are the sites, else the scale-out network of the group's devices (each of them copying
    its own shard)."""
    if cluster.sites > 1 and replicas == cluster.sites:
        return cluster.site_link_bytes_per_s * cluster.profile.levels[-1].efficiency
    level = cluster.profile.levels[-1 if cluster.sites == 1 else -2]
    devices = cluster.world_size // max(replicas, 1)
    return level.bandwidth_bytes_per_s * level.efficiency * devices


def choose(estimates: list[AlgorithmEstimate]) -> AlgorithmEstimate:
    """The candidate that reaches the token budget first (ties: the simplest, listed first)."""
    return min(estimates, key=lambda e: (round(e.time_to_budget_s, 6), _ORDER[e.name]))


_ORDER = {"sync": 0, "ft": 1, "diloco": 2}
