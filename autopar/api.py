"""The driver: the public entry points call the phases in order, one line each.

evaluate = trace -> build_tables -> Estimator.evaluate -> Plan
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate import CostOptions, Estimate, Estimator, build_tables
from autopar.plan import Plan, StagePlan
from autopar.tracing import ModelGraph, trace


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
    tables = build_tables(graph)
    estimator = Estimator(
        tables, cluster, precision=precision, optimizer=optimizer, options=options
    )
    estimate = estimator.evaluate(config, global_batch_size)
    return plan_from_estimate(estimate, graph, cluster, precision, optimizer)


def plan_from_estimate(
    estimate: Estimate, graph: ModelGraph, cluster: Cluster, precision: str, optimizer: str
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
    )
