"""solve_layer: ModelGraph + layer + Cluster + tp -> IntraLayerPlan, cached per layer class.

In: a traced `ModelGraph` (with its `graph_module`), a layer name, the cluster, the
tensor-parallel degree and options. Out: the `IntraLayerPlan` of the layer's class
representative. Invariant: the layers of one class share one plan (their structure is equal);
the plan's node names are the representative's.

The phases, one line each:
    group    = cluster.comm_group(range(tp))           # tp ranks inside one node first
    problem  = build_problem(graph, layer, tp, ...)     # strategies, folding, costs (problem.py)
    solution = solve_problem(problem, ...)              # CP-SAT (ilp.py)
    plan     = make_plan(graph, problem, solution, ...) # names and placements (plan.py)

Caching: `IntraLayerCache` is an explicit object the caller owns and passes in (no module
state); its key is the model (type, input shapes), the class (id, structural hash), tp, the
options and the cluster (profile, nodes, devices per node).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.hardware import Cluster
from autopar.solve.intra.ilp import solve_problem
from autopar.solve.intra.options import IntraOptions
from autopar.solve.intra.plan import IntraLayerPlan, make_plan
from autopar.solve.intra.problem import LayerProblem, build_problem
from autopar.tracing.graph import ModelGraph

CacheKey = tuple


@dataclass
class IntraLayerCache:
    """Plans by (model, layer class, tp, options, cluster); hits and misses are counted."""

    plans: dict[CacheKey, IntraLayerPlan] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def __len__(self) -> int:
        return len(self.plans)


def cache_key(
    graph: ModelGraph, layer_name: str, cluster: Cluster, tp: int, options: IntraOptions
) -> CacheKey:
    cls = graph.class_of(layer_name)
    where = (cluster.profile.name, cluster.num_nodes, cluster.devices_per_node)
    return (graph.model_type, graph.input_shapes, cls.id, cls.structural_hash, tp, options, where)


def layer_problem(
    graph: ModelGraph, layer_name: str, cluster: Cluster, tp: int, options: IntraOptions
) -> LayerProblem:
    """The ILP's input for `layer_name` on ranks 0..tp-1 (for tests and inspection)."""
    _check(graph, layer_name, cluster, tp)
    group = cluster.comm_group(range(tp))
    return build_problem(graph, layer_name, tp, cluster.profile.device, group, options)


def solve_layer(
    graph: ModelGraph,
    layer_name: str,
    cluster: Cluster,
    tp: int,
    *,
    sequence_parallel: bool | None = None,
    memory_budget_bytes: float | None = None,
    time_limit_s: float | None = None,
    options: IntraOptions | None = None,
    cache: IntraLayerCache | None = None,
) -> IntraLayerPlan:
    """Plan the placements of one layer's nodes on a tensor-parallel group of `tp` ranks.

    Args:
        graph: from `autopar.trace`.
        layer_name: any layer; its class representative is solved.
        cluster: the tp group is ranks 0..tp-1, i.e. inside one node when tp fits in one.
        tp: tensor-parallel degree (1 gives the all-replicated plan).
        sequence_parallel, memory_budget_bytes, time_limit_s: shorthands that override the
            fields of `options` of the same names.
        options: everything else (`IntraOptions`).
        cache: reuse and store plans here.

    Returns:
        The IntraLayerPlan; `plan.feasible` is False with `plan.infeasible_reason` naming the
        memory numbers when the budget cannot be met.

    Raises:
        ValueError: tp < 1 or larger than the cluster; KeyError: unknown layer.

    Example:
        >>> plan = solve_layer(graph, "layers.0", Cluster.from_profile("dgx_h100"), 8)
        >>> print(plan.as_text())
    """
    options = options or IntraOptions()
    overrides = dict(
        sequence_parallel=sequence_parallel,
        memory_budget_bytes=memory_budget_bytes,
        time_limit_s=time_limit_s,
    )
    options = replace(options, **{k: v for k, v in overrides.items() if v is not None})
    _check(graph, layer_name, cluster, tp)
    key = cache_key(graph, layer_name, cluster, tp, options)
    if cache is not None and key in cache.plans:
        cache.hits += 1
        return cache.plans[key]
    cls = graph.class_of(layer_name)
    representative = cls.representative
    problem = layer_problem(graph, representative, cluster, tp, options)
    solution = solve_problem(problem, options.time_limit_s, options.num_workers)
    group = cluster.comm_group(range(tp))
    plan = make_plan(graph, problem, solution, cls.id, options, group)
    if cache is not None:
        cache.misses += 1
        cache.plans[key] = plan
    return plan


def _check(graph: ModelGraph, layer_name: str, cluster: Cluster, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp > cluster.world_size:
        raise ValueError(f"tp={tp} is larger than the cluster's {cluster.world_size} devices")
    graph.layer(layer_name)  # KeyError listing the layers
