"""The training algorithm chosen: synchronous, fault-tolerant replica groups or DiLoCo.

In: the synchronous plan `parallelize` found for the whole cluster, for a cluster of several
sites the plan of one site with the global batch divided among the sites (what each DiLoCo
replica group runs), the cluster, `AlgorithmOptions` and the reliability data. Out: the plan
to return -- the synchronous one or the site's -- with its `training` record: every candidate
priced (`autopar.estimate.algorithms`), the one chosen, the token budget and the convergence
assumption, so that summary() and explain() need nothing else.

The candidates: synchronous training (always); fault-tolerant replica groups over the
data-parallel replicas (dp >= 2 of the synchronous plan, with reliability data); DiLoCo across
the sites (sites >= 2), each H in `AlgorithmOptions.inner_steps` with each fragment count in
`fragments`. ``choose`` other than "auto" keeps that algorithm where it applies.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.estimate.algorithms import (
    CONVERGENCE_SOURCE,
    AlgorithmEstimate,
    AlgorithmOptions,
    choose,
    cross_site_bytes,
    ft_step_cost,
    price_diloco,
    price_ft,
    price_sync,
    token_budget,
)
from autopar.hardware import Cluster, Reliability
from autopar.plan.types import Plan


def with_training(
    plan: Plan,
    site_plan: Plan | None,
    cluster: Cluster,
    options: AlgorithmOptions,
    reliability: Reliability | None,
) -> Plan:
    """The plan to return, with its `training` record (module docstring)."""
    reliability = reliability or cluster.profile.reliability
    budget = token_budget(options, plan.num_params)
    tokens = plan.global_batch_size * plan.seq_len
    cross = cross_site_bytes(plan.communication, plan.config, cluster)
    good = plan.goodput.get("async_goodput", 1.0)
    good = max(good, plan.goodput.get("sync_goodput", 0.0))
    sync = price_sync(plan.step_time_s, plan.config, tokens, cross, good, budget)
    candidates: list[AlgorithmEstimate] = [sync]
    if reliability is not None and plan.config.dp >= 2:
        torchft, _ = torchft_step_cost(plan, cluster, reliability.ft_control_s)
        candidates.append(
            price_ft(
                plan.step_time_s,
                plan.config,
                tokens,
                cross,
                budget,
                cluster,
                reliability,
                plan.num_params,
                plan.optimizer,
                plan.config.dp,
                options.ft_timeout_s,
                torchft,
            )  # fmt: skip
        )
    if site_plan is not None and cluster.sites > 1:
        for h in options.inner_steps:
            for f in options.fragments:
                candidates.append(
                    price_diloco(
                        site_plan.step_time_s,
                        site_plan.config,
                        tokens,
                        budget,
                        cluster,
                        reliability,
                        plan.num_params,
                        plan.optimizer,
                        options,
                        h,
                        f,
                    )  # fmt: skip
                )
    allowed = [c for c in candidates if options.choose in ("auto", c.name)] or [sync]
    best = choose(allowed)
    record = {
        "chosen": best.as_dict(),
        "candidates": [c.as_dict() for c in _best_of_each(candidates)],
        "token_budget": budget,
        "tokens_per_step": float(tokens),
        "sites": cluster.sites,
        "site_link_gbps": cluster.site_terms[1],
        "site_latency_s": cluster.site_latency_s,
        "assumption": CONVERGENCE_SOURCE.format(pct=options.diloco_token_overhead),
    }
    chosen = site_plan if best.name == "diloco" and site_plan is not None else plan
    notes = chosen.notes
    if best.name != "sync":
        notes = (*notes, _runtime_note(best))
    return replace(chosen, training=record, notes=notes)


def torchft_step_cost(plan: Plan, cluster: Cluster, control_s: float) -> tuple[float, float]:
    """`ft_step_cost` of ``plan``'s dp replicas as fault-tolerant groups: a rank's gradient
    bytes (its largest stage's), and the gradient sync its synchronous step exposed."""
    grads = max(s.memory_bytes.get("gradients", 0.0) for s in plan.stages)
    dp_comm = plan.breakdown.get("dp_comm", 0.0)
    return ft_step_cost(plan.config, cluster, grads, dp_comm, control_s)


def _best_of_each(candidates: list[AlgorithmEstimate]) -> list[AlgorithmEstimate]:
    """Synchronous, the best ft and, per fragment count, the best DiLoCo: what the plan lists."""
    best: dict[tuple[str, int], AlgorithmEstimate] = {}
    for c in candidates:
        key = (c.name, c.fragments if c.name == "diloco" else 0)
        if key not in best or c.time_to_budget_s < best[key].time_to_budget_s:
            best[key] = c
    return sorted(best.values(), key=lambda c: c.time_to_budget_s)


def _runtime_note(best: AlgorithmEstimate) -> str:
    if best.name == "diloco":
        return (
            f"training: DiLoCo over {best.replicas} sites (H={best.inner_steps}, "
            f"{best.fragments} fragment(s)); this plan is one site's replica group: start "
            "torchft_lighthouse once, and train.py at each site with --diloco-group G "
            "--lighthouse URL (autopar.runtime.diloco; launch.sbatch and pytorchjob.yaml do "
            "both: GROUP=g at each site)"
        )
    return (
        f"training: {best.replicas} fault-tolerant replica groups (torchft): start "
        f"torchft_lighthouse once, and train.py as {best.replicas} jobs of "
        f"1/{best.replicas} of the ranks with --ft-group G --lighthouse URL "
        "(autopar.runtime.fault_tolerance; launch.sbatch and pytorchjob.yaml do both)"
    )
