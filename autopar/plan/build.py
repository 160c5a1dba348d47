"""Plans made from the cost model's and the search's results.

In: an `Estimate` (`autopar.estimate`), the traced `ModelGraph`, the `Cluster`, the training
precision and optimizer, and for `parallelize` the `Solution` (`autopar.solve`). Out: a `Plan`:

    plan_from_estimate   the estimate's numbers, the mesh on the topology
                         (`autopar.estimate.layout.mesh_axes`) and each stage's collectives
                         (`autopar.estimate.communication`)
    with_sources         the model's factory and fingerprint (`ModelSource`) and the
                         cluster's fingerprint, so the program rebuilds the model and refuses
                         another one
    with_solution        what the search adds: alternatives and why they lost, notes, the
                         search's figures, the ILP's placements, the what-ifs, the timings

Invariant: a plan's values are JSON values (tuples for lists), so `Plan.from_json` of its
`to_json` equals it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

from torch import nn

from autopar.estimate import Estimate, Estimator
from autopar.estimate.communication import stage_communication
from autopar.estimate.goodput import estimate_goodput
from autopar.estimate.layout import mesh_axes
from autopar.estimate.memory import sequence_ends_gathered, vocab_whole
from autopar.hardware import Cluster, Reliability
from autopar.hardware.cluster import cluster_fingerprint
from autopar.models.source import import_root, model_fingerprint, resolve_callable
from autopar.plan.types import ModelSource, Plan, StagePlan
from autopar.solve import Solution
from autopar.solve.refine import RefineResult
from autopar.solve.search import SolverReport
from autopar.solve.space import SpaceLimits
from autopar.tracing import ModelGraph

# "module:function", or ("module:function", {kwargs}), or None: the model's own record
ModelFactory = str | tuple[str, dict[str, Any]] | None


def plan_from_estimate(
    estimate: Estimate,
    graph: ModelGraph,
    cluster: Cluster,
    precision: str,
    optimizer: str,
    estimator: Estimator | None = None,
) -> Plan:
    """The Plan of one priced config; with ``estimator``, its collectives per stage."""
    stages = tuple(
        StagePlan(
            index=s.index,
            layers=s.layers,
            forward_s=s.forward_s,
            backward_s=s.backward_s,
            memory_bytes={
                "parameters": s.memory.parameters_bytes,
                "gradients": s.memory.gradients_bytes,
                "optimizer": s.memory.optimizer_bytes,
                "activations": s.memory.activation_bytes,
                "buffers": s.memory.communication_buffer_bytes,
                "reserve": s.memory.reserve_bytes,
            },
            peak_memory_bytes=s.memory.total_bytes,
        )
        for s in estimate.stages
    )
    return Plan(
        model=graph.model_type,
        num_params=graph.num_params,
        seq_len=graph.input_shapes[0][-1] if graph.input_shapes else 1,
        cluster=cluster.profile.name,
        num_nodes=cluster.num_nodes,
        world_size=cluster.world_size,
        memory_capacity_bytes=cluster.profile.device.memory_bytes,
        config=estimate.config,
        global_batch_size=estimate.global_batch_size,
        num_microbatches=estimate.num_microbatches,
        precision=precision,
        optimizer=optimizer,
        step_time_s=estimate.step_time_s,
        peak_memory_bytes=estimate.peak_memory_bytes,
        mfu=estimate.mfu,
        breakdown=dict(estimate.breakdown),
        stages=stages,
        mesh=mesh_axes(cluster, estimate.config),
        communication=_communication(estimate, estimator),
        stack=(estimator.options.stack or "custom") if estimator is not None else "custom",
        experts=experts_of(graph, estimator.options.moe_imbalance if estimator else 1.0),
    )


def experts_of(graph: ModelGraph, imbalance: float = 1.0) -> dict[str, float]:
    """A mixture-of-experts model's routing as the plan prices it (`Plan.experts`): MoE
    layers, experts and top k (of the first MoE layer), the parameters a token passes
    through -- every parameter but the experts it is not routed to -- and the load imbalance
    priced (`CostOptions.moe_imbalance`)."""
    moe = [layer.moe for layer in graph.layers if layer.moe is not None]
    if not moe:
        return {}
    idle = sum(m.expert_params * (m.num_experts - m.top_k) for m in moe)
    return {
        "moe_layers": len(moe),
        "num_experts": moe[0].num_experts,
        "top_k": moe[0].top_k,
        "active_params": graph.num_params - idle,
        "imbalance": imbalance,
    }


def _communication(
    estimate: Estimate, estimator: Estimator | None
) -> tuple[tuple[dict[str, Any], ...], ...]:
    """The plan's collectives per stage (`autopar.estimate.communication`)."""
    if estimator is None:
        return ()
    per_stage = stage_communication(
        estimator.tables,
        estimate.config,
        [s.layers for s in estimate.stages],
        estimate.num_microbatches,
        precision=estimator.precision,
        grad_bytes=estimator.options.grad_bytes,
        act_scale=estimator.act_scale,
        vocab_whole=vocab_whole(estimate.config, estimator.options),
        ends_gathered=sequence_ends_gathered(estimate.config, estimator.tables, estimator.options),
    )
    return tuple(tuple(c.as_dict() for c in stage) for stage in per_stage)


def with_goodput(plan: Plan, cluster: Cluster, reliability: Reliability | None) -> Plan:
    """``plan`` with its goodput under failures (`autopar.estimate.goodput`), priced from
    ``reliability`` or else the profile's; unchanged when neither has failure data."""
    reliability = reliability or cluster.profile.reliability
    if reliability is None:
        return plan
    est = estimate_goodput(
        plan.num_params, plan.optimizer, plan.config, plan.step_time_s, cluster, reliability
    )
    return replace(plan, goodput=est.as_dict())


def with_sources(
    plan: Plan,
    model: nn.Module,
    factory: ModelFactory,
    cluster: Cluster,
    loss: str | None = None,
) -> Plan:
    """``plan`` with its model_source (factory, JSON kwargs, fingerprint) and the cluster's
    fingerprint. ``factory`` None takes the one the zoo and Hugging Face builders record on
    the model (`model.autopar_factory`); a model without one gets no model_source.

    Raises:
        ValueError: the factory is not "module:function" or its kwargs are not JSON values.
    """
    cluster_fp = cluster_fingerprint(
        cluster.profile.name, cluster.num_nodes, cluster.devices_per_node, cluster.site_terms
    )
    if factory is None:
        recorded = getattr(model, "autopar_factory", None)
        factory = (recorded["factory"], recorded["kwargs"]) if recorded else None
    if factory is None:
        return replace(plan, model_source=None, cluster_fingerprint=cluster_fp)
    path, kwargs = (factory, {}) if isinstance(factory, str) else factory
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"model_factory must be 'module:function' (with kwargs), got {path!r}")
    try:
        kwargs = json.loads(json.dumps(kwargs))  # JSON values only; tuples become lists
    except TypeError as e:
        raise ValueError(f"model_factory kwargs must be JSON values: {e}") from None
    if loss is not None:
        resolve_callable(loss)  # ValueError now, not on the cluster: a loss that imports
    source = ModelSource(path, kwargs, model_fingerprint(model), loss, import_root(path, loss))
    # the user handed over this model or factory: its program may call the factory
    return replace(plan, model_source=source, cluster_fingerprint=cluster_fp, trusted_factory=True)


def with_solution(
    plan: Plan,
    solution: Solution,
    limits: SpaceLimits,
    notes: list[str],
    timings: dict[str, float],
) -> Plan:
    """``plan`` with what the search adds (module docstring); ``notes`` come first."""
    placements, ilp = _intra_layer_placements(solution.refined)
    report = solution.report
    return replace(
        plan,
        alternatives=solution.alternatives,
        notes=(*notes, *solution.notes),
        report={
            "text": report.as_text(timings=False),
            **_report_fields(report),
            "ilp": ilp,
            "refine": solution.refined.report(),
            "limits": json.loads(json.dumps(asdict(limits))),  # JSON values: the plan reloads
        },
        placements=placements,
        sensitivity=solution.sensitivity,
        timings=timings,
    )


def _intra_layer_placements(
    refined: RefineResult,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per repeated-layer class, the ILP's placements at the chosen tensor-parallel degree
    (the plans the refinement solved for the winner)."""
    placements: dict[str, Any] = {}
    stats: list[dict[str, Any]] = []
    for cls_id, sol in refined.plans.items():
        placements[cls_id] = {
            "layer": sol.layer,
            "parameters": dict(sol.parameter_placements),
            "nodes": {k: ",".join(v) for k, v in sol.placements.items()},
            "collectives": [str(c) for c in sol.collectives],
        }
        stats.append(
            {
                "class": cls_id,
                "status": sol.status,
                "variables": sol.num_variables,
                "constraints": sol.num_constraints,
            }
        )
    return placements, stats


def _report_fields(report: SolverReport) -> dict[str, Any]:
    return {
        "num_degree_choices": report.num_degree_choices,
        "num_configs": report.num_configs,
        "pruned": dict(report.pruned),
        "num_evaluated": report.num_evaluated,
        "num_feasible": report.num_feasible,
        "num_unsearched": report.num_unsearched,
        "optimality_gap": report.optimality_gap,
    }
