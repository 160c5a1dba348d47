"""IntraLayerPlan: what the intra-layer ILP decided for one layer, as frozen, printable data.

In: the `LayerProblem`, the ILP's `Solution`, the `ModelGraph` (for parameter names) and the
group the collectives run on. Out: an `IntraLayerPlan` whose placements are short strings
("R", "S(2)", "P(sum)"), keyed by node name; parameters by their FQN. Invariant:
`compute_s + communication_s` is the objective in seconds (up to the integer rounding of the
ILP's units), with `communication_s` = 2 x the forward collectives (mirrored in the backward)
plus the weight-gradient all-reduces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autopar.solve.intra.ilp import Solution
from autopar.solve.intra.options import IntraOptions
from autopar.solve.intra.problem import LayerProblem
from autopar.solve.intra.reshard import reshard_collective
from autopar.solve.intra.strategies import describe
from autopar.tracing.graph import ModelGraph
from cost_models.comm import Group, collective_time


@dataclass(frozen=True)
class PlannedCollective:
    """One forward redistribution the plan needs (codegen inserts it as an explicit node)."""

    producer: str
    consumer: str  # a node name, or "<name>:out" for the layer's boundary
    src: str
    dst: str
    collective: str
    message_bytes: float
    time_s: float


@dataclass(frozen=True)
class IntraLayerPlan:
    layer: str  # the layer that was solved (the class representative)
    layer_class: str
    tp: int
    options: IntraOptions
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    solve_time_s: float
    num_variables: int
    num_constraints: int
    num_groups: int  # ILP decisions after folding
    num_nodes: int  # call nodes of the layer
    objective: int | None  # in units of options.unit_s
    placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    input_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    parameter_placements: Mapping[str, str] = field(default_factory=dict)
    collectives: tuple[PlannedCollective, ...] = ()
    grad_syncs: tuple[str, ...] = ()  # parameters whose gradient is all-reduced over tp
    compute_s: float = 0.0
    communication_s: float = 0.0
    parameter_bytes: float = 0.0  # per rank, times options.param_memory_factor
    activation_bytes: float = 0.0  # per rank, saved for the backward
    replicated_ops: tuple[tuple[str, str], ...] = ()  # (node, op) with no sharding rule
    infeasible_reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE")

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def memory_bytes(self) -> float:
        return self.parameter_bytes + self.activation_bytes

    def collective_counts(self, min_bytes: float = 0.0) -> dict[str, int]:
        """Forward collectives by kind, ignoring messages under `min_bytes`."""
        counts: dict[str, int] = {}
        for c in self.collectives:
            if c.message_bytes >= min_bytes:
                counts[c.collective] = counts.get(c.collective, 0) + 1
        return counts

    def as_text(self) -> str:
        head = (
            f"intra-layer plan of {self.layer} (class {self.layer_class}) on tp={self.tp}"
            f"{' with sequence parallelism' if self.options.sequence_parallel else ''}: "
            f"{self.status}"
        )
        if not self.feasible:
            return f"{head}\n  {self.infeasible_reason}"
        lines = [
            head,
            f"  ILP: {self.num_nodes} nodes folded into {self.num_groups} decisions, "
            f"{self.num_variables} variables, {self.num_constraints} constraints, "
            f"solved in {self.solve_time_s * 1e3:.1f} ms",
            f"  time per micro-batch (fwd+bwd): {self.total_s * 1e3:.3f} ms = compute "
            f"{self.compute_s * 1e3:.3f} ms + communication {self.communication_s * 1e3:.3f} ms",
            f"  memory per rank: {self.memory_bytes / 2**20:.2f} MiB (parameters "
            f"{self.parameter_bytes / 2**20:.2f}, saved activations "
            f"{self.activation_bytes / 2**20:.2f})",
            "  parameters:",
        ]
        lines += [f"    {k:<48} {v}" for k, v in self.parameter_placements.items()]
        lines.append("  nodes (output <- inputs):")
        for name, out in self.placements.items():
            ins = self.input_placements.get(name)
            arrow = f" <- {', '.join(ins)}" if ins else ""
            lines.append(f"    {name:<32} {', '.join(out)}{arrow}")
        lines.append("  forward collectives:")
        for c in self.collectives:
            lines.append(
                f"    {c.collective:<15} {c.producer} -> {c.consumer}: {c.src} -> {c.dst}, "
                f"{c.message_bytes / 2**20:.2f} MiB, {c.time_s * 1e6:.1f} us"
            )
        if self.grad_syncs:
            lines.append(f"  gradient all-reduces: {', '.join(self.grad_syncs)}")
        if self.replicated_ops:
            ops = ", ".join(f"{n} ({op})" for n, op in self.replicated_ops)
            lines.append(f"  replicated, no sharding rule: {ops}")
        return "\n".join(lines)


def _collective(
    producer: str, consumer: str, src, dst, full_bytes: float, t: int, group: Group
) -> PlannedCollective | None:
    step = reshard_collective(src, dst, full_bytes, t)
    if step is None:
        return None
    kind, message = step
    time_s = collective_time(kind, message, group).time_s
    return PlannedCollective(
        producer, consumer, describe(src), describe(dst), kind, message, time_s
    )


def make_plan(
    graph: ModelGraph,
    problem: LayerProblem,
    solution: Solution,
    layer_class: str,
    options: IntraOptions,
    group: Group,
) -> IntraLayerPlan:
    """Read the solution back into names and placements (see the module docstring)."""
    num_nodes = sum(1 for n in graph.layer(problem.layer).nodes if graph.nodes[n].kind == "call")
    common = dict(
        layer=problem.layer,
        layer_class=layer_class,
        tp=problem.t,
        options=options,
        status=solution.status,
        solve_time_s=solution.solve_time_s,
        num_variables=solution.num_variables,
        num_constraints=solution.num_constraints,
        num_groups=sum(1 for g in problem.groups if len(g.choices) > 1),
        num_nodes=num_nodes,
        objective=solution.objective,
        replicated_ops=problem.replicated_ops,
    )
    if solution.objective is None:
        return IntraLayerPlan(**common, infeasible_reason=solution.infeasible_reason)
    chosen = {g.name: g.choices[solution.picks[g.name]] for g in problem.groups}
    placements, inputs, params = {}, {}, {}
    collectives: list[PlannedCollective] = []
    compute_s = comm_s = param_bytes = act_bytes = 0.0
    syncs: list[str] = []
    for g in problem.groups:
        c = chosen[g.name]
        compute_s += c.compute_s
        comm_s += c.comm_s
        syncs += [graph.nodes[p].params[0] if graph.nodes[p].params else p for p in c.grad_syncs]
        if g.kind == "parameter":
            fqn = graph.nodes[g.name].params
            params[fqn[0] if fqn else g.name] = describe(c.outputs[g.name][0])
            param_bytes += c.memory_bytes
            continue
        act_bytes += c.memory_bytes
        for m in g.members:
            if m != g.name or g.kind == "op":
                placements[m] = tuple(describe(p) for p in c.outputs[m])
        if g.kind == "op":
            inputs[g.name] = tuple(describe(p) for p in c.inputs)
        for producer, consumer, src, dst, full_bytes in c.internal:
            pc = _collective(producer, consumer, src, dst, full_bytes, problem.t, group)
            if pc is not None:
                collectives.append(pc)
    for e in problem.edges:
        if e.kind != "reshard":
            continue
        src, dst = chosen[e.src].outputs[e.member][0], chosen[e.dst].inputs[e.input]
        pc = _collective(e.member, e.dst, src, dst, e.full_bytes, problem.t, group)
        if pc is not None:
            collectives.append(pc)
            comm_s += 2 * pc.time_s
    return IntraLayerPlan(
        **common,
        placements=placements,
        input_placements=inputs,
        parameter_placements=params,
        collectives=tuple(collectives),
        grad_syncs=tuple(syncs),
        compute_s=compute_s,
        communication_s=comm_s,
        parameter_bytes=param_bytes,
        activation_bytes=act_bytes + problem.memory_constant_bytes,
    )
