"""What-ifs: re-plan the same model on a changed cluster, for the plan's sensitivity lines.

In: the model's cost tables, the cluster, the search's limits and the chosen estimate. Out: one
JSON-ready `dict` per scenario that `Plan.explain()` prints:

    what                     "2x inter-node bandwidth", "+50% HBM"
    config                   the config the search picks on the changed cluster
    step_time_s              its step time
    same_config_step_time_s  the chosen config's step time on the changed cluster
    baseline_step_time_s     the chosen config's step time on the real cluster
    skipped                  why the scenario does not apply (a one-node cluster has no
                             inter-node links), else absent

Invariant: the scenario only adds bandwidth or memory, so the plan it picks is never slower
than the baseline: the search space and its divisibility are unchanged, the baseline config
stays feasible (memory does not shrink) and the cost model does not charge more for a faster
link. The result takes the faster of the search's best and the baseline config re-priced, so
the invariant holds also when a time limit stops the search early. Where the chosen plan keeps
each expert whole on every tp rank (etp = 1), so do the re-plans: splitting experts over tp
trades time for memory, and searching it doubles an MoE model's tensor-parallel space (the
re-plans of DeepSeek-V3 on 1,024 H100 took 40 s with it, 20 s without).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.errors import AutoparError
from autopar.estimate import CostOptions, Estimate, Estimator, ModelTables
from autopar.hardware import Cluster
from autopar.solve.search import search
from autopar.solve.space import SpaceLimits

INTER_NODE_FACTOR = 2.0
MEMORY_FACTOR = 1.5


def scaled_cluster(
    cluster: Cluster, *, inter_node_bandwidth: float = 1.0, memory: float = 1.0
) -> Cluster:
    """``cluster`` with its inter-node links ``inter_node_bandwidth`` times faster and its
    device memory ``memory`` times larger (a TPU torus scales its ICI links).

    Inter-node levels are those whose domain is larger than a node (or the whole cluster).

    Example:
        >>> big = scaled_cluster(Cluster.from_profile("dgx_h100", 2), memory=1.5)
    """
    profile = cluster.profile
    if inter_node_bandwidth != 1.0:
        if profile.torus is not None:
            torus = profile.torus
            faster = torus.link_bandwidth_bytes_per_s * inter_node_bandwidth
            profile = replace(profile, torus=replace(torus, link_bandwidth_bytes_per_s=faster))
        else:
            levels = tuple(
                replace(lv, bandwidth_bytes_per_s=lv.bandwidth_bytes_per_s * inter_node_bandwidth)
                if _is_inter_node(lv.devices_per_domain, profile.devices_per_node)
                else lv
                for lv in profile.levels
            )
            profile = replace(profile, levels=levels)
    if memory != 1.0:
        device = replace(profile.device, memory_bytes=profile.device.memory_bytes * memory)
        profile = replace(profile, device=device)
    return replace(cluster, profile=profile)


def _is_inter_node(devices_per_domain: int, devices_per_node: int) -> bool:
    return devices_per_domain == 0 or devices_per_domain > devices_per_node


def sensitivity(
    tables: ModelTables,
    cluster: Cluster,
    limits: SpaceLimits,
    best: Estimate,
    *,
    precision: str,
    optimizer: str,
    options: CostOptions,
    time_limit_s: float | None = None,
    base: Estimator | None = None,
) -> tuple[dict[str, Any], ...]:
    """Re-plan on 2x inter-node bandwidth and on +50% HBM (module docstring). ``base``: the
    search's estimator on ``cluster``; the +50% HBM scenario prices every config as it does
    (memory changes only what fits), so it searches with it, its caches warm, at the larger
    capacity."""
    scenarios = [
        (
            f"{INTER_NODE_FACTOR:g}x "
            + ("ICI link" if cluster.profile.torus is not None else "inter-node")
            + " bandwidth",
            scaled_cluster(cluster, inter_node_bandwidth=INTER_NODE_FACTOR),
            _no_inter_node(cluster),
            False,
        ),
        (
            f"+{MEMORY_FACTOR - 1:.0%} HBM",
            scaled_cluster(cluster, memory=MEMORY_FACTOR),
            None,
            True,  # memory only: every config prices as on ``cluster``
        ),
    ]
    if best.config.etp == 1:  # the plan's expert layout (module docstring)
        limits = replace(limits, expert_width=0)
    out: list[dict[str, Any]] = []
    for what, changed, skipped, memory_only in scenarios:
        entry: dict[str, Any] = {"what": what, "baseline_step_time_s": best.step_time_s}
        if skipped:
            out.append({**entry, "skipped": skipped})
            continue
        capacity = changed.profile.device.memory_bytes
        if base is not None and memory_only:
            estimator = base
        else:
            estimator = Estimator(
                tables, changed, precision=precision, optimizer=optimizer, options=options
            )
        same = estimator.evaluate(best.config, limits.global_batch_size)
        try:
            # the chosen config fits the changed cluster too: only faster ones are of
            # interest, so its time bounds the search from the start (InfeasibleError: none)
            found = search(
                estimator,
                limits,
                max_alternatives=0,
                time_limit_s=time_limit_s,
                incumbent_s=same.step_time_s,
                capacity_bytes=capacity,
            ).best
        except AutoparError:  # nothing beats the chosen config on the changed cluster
            found = same
        pick = found if found.step_time_s < same.step_time_s else same
        out.append(
            {
                **entry,
                "config": pick.config.as_text(),
                "step_time_s": pick.step_time_s,
                "same_config_step_time_s": same.step_time_s,
            }
        )
    return tuple(out)


def _no_inter_node(cluster: Cluster) -> str | None:
    if cluster.profile.torus is not None:
        return None
    if cluster.num_nodes == 1:
        return "one node: no inter-node links to speed up"
    return None
