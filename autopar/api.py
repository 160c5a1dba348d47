"""The driver: the public entry points call the phases in order, one line each.

evaluate = trace -> build_tables -> Estimator.evaluate -> Plan
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate import CostOptions, Estimate, Estimator, build_tables
from autopar.estimate.communication import stage_communication
from autopar.layout import mesh_axes
from autopar.plan import ModelSource, Plan, StagePlan
from autopar.solve.refine import (
    RecordingEstimator,
    RefineOptions,
    RefineResult,
    refine,
    refined_alternatives,
    refined_note,
)
from autopar.solve.search import search
from autopar.solve.space import SpaceLimits, shape_problems
from autopar.tracing import ModelGraph, trace
from autopar.whatif import sensitivity

# DESIGN.md: the default global batch is about 4M tokens, a power of two in sequences.
DEFAULT_BATCH_TOKENS = 4 * 2**20


@dataclass(frozen=True)
class PlanOptions:
    """How parallelize searches: the cost model's options and the search's own knobs."""

    cost: CostOptions = field(default_factory=lambda: CostOptions(balance_stages=True))
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_alternatives: int = 5
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    # stop pricing new degree choices after this many seconds once a plan fits; the plan
    # then says it is the best found and bounds its optimality gap (None: search it all)
    time_limit_s: float | None = None
    # re-plan on 2x inter-node bandwidth and on +50% HBM for explain() (`autopar.whatif`);
    # two more searches on the same cost tables
    sensitivity: bool = True
    # the search's top configs re-priced by the intra-layer ILP (`autopar.solve.refine`)
    refine: RefineOptions = field(default_factory=RefineOptions)


def parallelize(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Any = None,
    *,
    global_batch_size: int | None = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
    options: PlanOptions | None = None,
    graph: ModelGraph | None = None,
    model_factory: ModelFactory = None,
) -> Plan:
    """Find the fastest parallel configuration of ``model`` on ``cluster`` that fits in memory.

    Args:
        model: the model (parameters may be on the meta device).
        cluster: from `Cluster.from_profile`.
        example_inputs: one sample's inputs; inferred (token ids of the model's context length)
            for Hugging Face causal LMs and the zoo's language models when omitted.
        global_batch_size: sequences per step; default about 4M tokens (stated in the plan).
        precision, optimizer: as for `evaluate`.
        options: PlanOptions (cost-model options, micro-batch sizes, progress callback).
        graph: a ModelGraph already traced from this model and inputs.
        model_factory: how the generated program builds the model: "module:function", or
            ("module:function", {kwargs}); default: the factory the zoo and Hugging Face
            builders record on the model (`model.autopar_factory`), else none (`plan.save`
            then writes plan.json only).

    Returns:
        The best Plan, with `alternatives` (why each lost) and `report` (the search's figures).

    Raises:
        InfeasibleError: nothing fits; says how much memory the most frugal config needs and the
            smallest number of nodes that would hold it.
    """
    options = options or PlanOptions()
    notes: list[str] = []
    t0 = time.perf_counter()
    if graph is None:
        if example_inputs is None:
            example_inputs = infer_example_inputs(model)
            notes.append(f"inputs inferred: token ids of shape {tuple(example_inputs[0].shape)}")
        graph = trace(model, example_inputs)
    trace_s = time.perf_counter() - t0
    seq_len = graph.input_shapes[0][-1] if graph.input_shapes else 1
    if global_batch_size is None:
        global_batch_size = default_global_batch(seq_len)
        notes.append(
            f"global batch not given: {global_batch_size} sequences "
            f"({global_batch_size * seq_len:,} tokens, about 4M)"
        )
    tables = build_tables(graph)
    estimator = RecordingEstimator(
        tables, cluster, precision=precision, optimizer=optimizer, options=options.cost
    )
    limits = space_limits(model, graph, cluster, global_batch_size, options.micro_batch_sizes)
    result = search(
        estimator,
        limits,
        max_alternatives=options.max_alternatives,
        progress=options.progress,
        time_limit_s=options.time_limit_s,
    )
    t_ilp = time.perf_counter()
    refined = refine(
        estimator,
        estimator.priced,
        graph,
        cluster,
        global_batch_size,
        result.best,
        options.refine,
    )
    ilp_s = time.perf_counter() - t_ilp
    best = refined.best
    plan = plan_from_estimate(best, graph, cluster, precision, optimizer, estimator)
    plan = replace(plan, **_sources(model, model_factory, cluster))
    report = replace(result.report, trace_time_s=trace_s)
    if report.num_unsearched:
        notes.append(
            f"search stopped at its time limit ({options.time_limit_s} s): "
            f"{report.num_unsearched} of {report.num_degree_choices} degree choices unsearched; "
            f"this is the best plan found, at most {report.optimality_gap:.0%} slower than the "
            "optimum (compute bound)"
        )
    alternatives = result.alternatives
    if refined.changed:
        notes.append(refined_note(refined, result.best))
        alternatives = refined_alternatives(refined, result, options.max_alternatives)
    placements, ilp = _intra_layer_placements(refined)
    t_whatif = time.perf_counter()
    what_if = ()
    if options.sensitivity:
        what_if = sensitivity(
            tables,
            cluster,
            limits,
            best,
            precision=precision,
            optimizer=optimizer,
            options=options.cost,
            time_limit_s=options.time_limit_s,
        )
    whatif_s = time.perf_counter() - t_whatif
    return replace(
        plan,
        alternatives=alternatives,
        notes=tuple(notes),
        report={
            "text": report.as_text(timings=False),
            **_report_fields(report),
            "ilp": ilp,
            "refine": refined.report(),
            "limits": json.loads(json.dumps(asdict(limits))),  # JSON values: the plan reloads
        },
        placements=placements,
        sensitivity=what_if,
        timings={
            "trace": trace_s,
            "search": report.search_time_s,
            "ilp": ilp_s,
            "what-if": whatif_s,
            "total": time.perf_counter() - t0,
        },
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


def _report_fields(report: Any) -> dict[str, Any]:
    return {
        "num_degree_choices": report.num_degree_choices,
        "num_configs": report.num_configs,
        "pruned": dict(report.pruned),
        "num_evaluated": report.num_evaluated,
        "num_feasible": report.num_feasible,
        "num_unsearched": report.num_unsearched,
        "optimality_gap": report.optimality_gap,
    }


def default_global_batch(seq_len: int) -> int:
    """The power of two in sequences nearest to 4M tokens."""
    target = max(1, DEFAULT_BATCH_TOKENS // max(seq_len, 1))
    power = 1
    while power * 2 <= target:
        power *= 2
    return power


def infer_example_inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """Token ids of the model's context length for HF causal LMs and the zoo's LMs."""
    config = getattr(model, "config", None)
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_len", None)
    if seq is None:
        raise ValueError(
            f"cannot infer example inputs for {type(model).__name__}: pass example_inputs "
            "(one sample, batch dimension 1)"
        )
    device = next(model.parameters()).device
    return (torch.zeros(1, int(seq), dtype=torch.long, device=device),)


def space_limits(
    model: nn.Module,
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
) -> SpaceLimits:
    """The model's and cluster's facts that bound the search space and refuse configs."""
    return SpaceLimits(
        world_size=cluster.world_size,
        devices_per_node=cluster.devices_per_node,
        num_blocks=sum(1 for layer in graph.layers if layer.kind == "block"),
        num_heads=attention_heads(graph),
        seq_len=graph.input_shapes[0][-1] if graph.input_shapes else 1,
        num_experts=max((layer.moe.num_experts for layer in graph.layers if layer.moe), default=0),
        global_batch_size=global_batch_size,
        micro_batch_sizes=micro_batch_sizes,
        num_kv_heads=_kv_heads(model),
    )


def _kv_heads(model: nn.Module) -> int:
    """Key/value heads from the model's config (zoo: num_kv_heads, Hugging Face:
    num_key_value_heads); 0 when the model does not say."""
    config = getattr(model, "config", None)
    for name in ("num_kv_heads", "num_key_value_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def attention_heads(graph: ModelGraph) -> int:
    """Heads of the first attention in the model (the tp degree must divide them), 0 if none."""
    for node in graph.nodes.values():
        if node.op_class == "attention" and node.inputs:
            q = graph.nodes[node.inputs[0]]
            if q.shapes and len(q.shapes[0]) == 4:
                return q.shapes[0][1]
    for node in graph.nodes.values():  # step-by-step attention: scores are [b, heads, s, s]
        if (
            node.op_class == "matmul"
            and not node.params
            and node.shapes
            and len(node.shapes[0]) == 4
        ):
            return node.shapes[0][1]
    return 0


def evaluate(
    model: nn.Module,
    cluster: Cluster,
    config: ParallelConfig,
    example_inputs: Any = None,
    *,
    global_batch_size: int,
    precision: str = "bf16",
    optimizer: str = "adamw",
    options: CostOptions | None = None,
    graph: ModelGraph | None = None,
    model_factory: ModelFactory = None,
) -> Plan:
    """Price one parallel configuration of ``model`` on ``cluster`` with autopar's cost model.

    Args:
        model: the model (parameters may be on the meta device).
        cluster: from `Cluster.from_profile`.
        config: the degrees, schedule, recompute policy, micro-batch size to price.
        example_inputs: one sample's inputs (batch 1); not needed when ``graph`` is given.
        global_batch_size: sequences per optimizer step.
        precision: "bf16", "fp16" or "fp32" (training dtype; fp32 master weights otherwise).
        optimizer: "adamw", "adam", "sgd", "sgd_momentum".
        options: framework behaviour (overlaps, buffer sizes); defaults: `CostOptions()`.
        graph: a ModelGraph already traced from this model and inputs (skips tracing).
        model_factory: as for `parallelize`: what the saved program calls to build the model.

    Returns:
        A Plan with the predicted step time, its breakdown, memory per stage and MFU.

    Raises:
        ConfigError: the config does not fit the cluster or the batch.
        TraceError: the model cannot be traced.
    """
    if graph is None:
        if example_inputs is None:
            raise ValueError("evaluate needs example_inputs (one sample) or a traced graph")
        graph = trace(model, example_inputs)
    problems = config.problems(cluster) + shape_problems(
        config, space_limits(model, graph, cluster, global_batch_size)
    )
    if problems:
        raise ConfigError(
            f"config {config.as_text()} cannot run {graph.model_type} on "
            f"{cluster.profile.name} x {cluster.num_nodes} ({cluster.world_size} devices): "
            + "; ".join(problems)
        )
    tables = build_tables(graph)
    estimator = Estimator(
        tables, cluster, precision=precision, optimizer=optimizer, options=options
    )
    estimate = estimator.evaluate(config, global_batch_size)
    plan = plan_from_estimate(estimate, graph, cluster, precision, optimizer, estimator)
    return replace(plan, **_sources(model, model_factory, cluster))


ModelFactory = str | tuple[str, dict[str, Any]] | None


def _sources(model: nn.Module, factory: ModelFactory, cluster: Cluster) -> dict[str, Any]:
    """The plan's model_source (factory, JSON kwargs, fingerprint) and cluster_fingerprint."""
    from autopar.runtime.task import model_fingerprint

    where = f"{cluster.profile.name}|{cluster.num_nodes}|{cluster.devices_per_node}"
    cluster_fp = hashlib.sha256(f"{where}|{cluster.world_size}".encode()).hexdigest()[:16]
    if factory is None:
        recorded = getattr(model, "autopar_factory", None)
        factory = (recorded["factory"], recorded["kwargs"]) if recorded else None
    if factory is None:
        return {"model_source": None, "cluster_fingerprint": cluster_fp}
    path, kwargs = (factory, {}) if isinstance(factory, str) else factory
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"model_factory must be 'module:function' (with kwargs), got {path!r}")
    try:
        kwargs = json.loads(json.dumps(kwargs))  # JSON values only; tuples become lists
    except TypeError as e:
        raise ValueError(f"model_factory kwargs must be JSON values: {e}") from None
    source = ModelSource(path, kwargs, model_fingerprint(model))
    return {"model_source": source, "cluster_fingerprint": cluster_fp}


def plan_from_estimate(
    estimate: Estimate,
    graph: ModelGraph,
    cluster: Cluster,
    precision: str,
    optimizer: str,
    estimator: Estimator | None = None,
) -> Plan:
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
    )


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
    )
    return tuple(tuple(c.as_dict() for c in stage) for stage in per_stage)
