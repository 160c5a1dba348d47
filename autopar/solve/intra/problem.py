"""One layer's sharding problem as plain data: groups of nodes, their choices, and edges.

In: a `ModelGraph`, a layer name, t, the device, the tensor-parallel group and `IntraOptions`.
Out: a frozen `LayerProblem` that the ILP (`ilp.solve_problem`) and the brute-force reference
(`LayerProblem.evaluate` over every pick) both read, so they price exactly the same thing.

Groups (one decision each):
- "op": a non-trivial call node (the root) plus the trivial nodes folded into it. Its choices
  are the root's strategies (`strategies.node_strategies`).
- "parameter": a parameter; its choices are R and S(d) for every dim t divides.
- "input": a tensor from outside the layer, fixed at the boundary placement (R, or S(seq)
  with sequence parallelism for activations that need grad; constants such as RoPE tables R).
- "output": a sink per node read outside the layer, requiring the boundary placement.

Folding ("trivial ops follow their producer"): a view, a getitem, or an elementwise op with a
single tensor input joins its producer's group. For each choice c of that group, the folded
node takes the strategy s of its own whose input is p = out_c(producer) (the cheapest such);
when DTensor has none for p (a view that cannot keep the split, silu of a Partial), the s
minimising 2 * reshard(p -> in_s) + compute_s, the redistribution happening inside the group.
s's output placement is recorded and its cost added to c. Folding shrinks the ILP at the price
of optimality: the folded node cannot pick a placement its producer's choice does not imply.

Costs, in integer units of `unit_s` (default 1 ns, because a tiny layer's ops differ by less
than a microsecond; whole microseconds would be the coarser choice of the same scheme):
    cost(c)       = round((forward_s + backward_s + 2 * folded reshards
                           + weight-grad all-reduces) / unit_s)
    cost(p -> q)  = round(2 * reshard_time_s(p, q, bytes, t, group) / unit_s)   on an edge
The factor 2 mirrors each forward redistribution in the backward (an all-reduce's conjugate is
an all-reduce, an all-gather's a reduce-scatter of the same bytes: Megatron's f/g pairs). A
parameter used replicated by a strategy that splits the work (or reads a Partial) gets a
Partial gradient: one all-reduce of its bytes per fwd+bwd is charged to that strategy.

Edges: (group A, member a) -> (group B, tensor input k of B's root). "reshard" edges cost
cost(p -> q) with p = out_{c_A}(a), q = in_{c_B}(k); "match" edges (A a parameter group) require
p == q: a parameter is stored as its consumer uses it, never redistributed.

Memory per rank (bytes): sum over chosen choices of memory(c), where memory(c) is
    parameter:  factor * bytes / (t if Shard else 1)        (factor: `param_memory_factor`)
    op/input:   sum over saved members m (`LayerInfo.saved_values[recompute]`) of
                micro_batch * local_bytes(out_c(m))
plus a constant: the op-internal saved bytes (`saved_internal_bytes`, e.g. attention's
log-sum-exp), charged unsharded.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.fx import Node

from autopar.solve.intra.options import IntraOptions
from autopar.solve.intra.reshard import reshard_time_s
from autopar.solve.intra.strategies import (
    PRECISION_BYTES,
    NodeStrategies,
    Strategy,
    candidate_placements,
    local_bytes,
    node_strategies,
    output_metas,
    splits_work,
    tensor_inputs,
)
from autopar.tracing.graph import ModelGraph
from cost_models.comm import Group as CommGroup
from cost_models.comm import collective_time
from cost_models.compute import DeviceSpec

GroupKind = Literal["op", "parameter", "input", "output"]


@dataclass(frozen=True)
class Choice:
    label: str
    cost: int  # units: round((compute_s + comm_s) / unit_s)
    outputs: Mapping[str, tuple[Placement, ...]]  # member -> its output placement(s)
    inputs: tuple[Placement, ...]  # required placement of the root's tensor inputs
    memory_bytes: float = 0.0
    compute_s: float = 0.0  # forward + backward of the members
    comm_s: float = 0.0  # folded reshards (x2) and weight-gradient all-reduces
    # (producer, consumer, from, to, full bytes): forward redistributions inside the group
    internal: tuple[tuple[str, str, Placement, Placement, float], ...] = ()
    grad_syncs: tuple[str, ...] = ()  # parameters whose gradient is all-reduced


@dataclass(frozen=True)
class Group:
    name: str  # the root node
    kind: GroupKind
    members: tuple[str, ...]
    choices: tuple[Choice, ...]
    source: str = ""  # where the root's strategies came from ("dtensor", "rule", ...)


@dataclass(frozen=True)
class Edge:
    src: str  # group
    member: str  # the node of src whose output flows
    dst: str  # group
    input: int  # index into dst's `Choice.inputs`
    kind: Literal["reshard", "match"]
    full_bytes: float  # of the tensor, whole (micro-batch scaled)
    costs: Mapping[tuple[Placement, Placement], int] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerProblem:
    layer: str
    t: int
    unit_s: float
    groups: tuple[Group, ...]
    edges: tuple[Edge, ...]
    memory_budget_bytes: float | None
    memory_constant_bytes: float
    replicated_ops: tuple[tuple[str, str], ...] = ()  # (node, op): no rule, planned replicated

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def evaluate(self, picks: Mapping[str, int]) -> int | None:
        """Objective (units) of one choice per group, None if a constraint is violated."""
        chosen = {g.name: g.choices[picks.get(g.name, 0)] for g in self.groups}
        total = sum(c.cost for c in chosen.values())
        for e in self.edges:
            p = chosen[e.src].outputs[e.member][0]
            q = chosen[e.dst].inputs[e.input]
            if e.kind == "match":
                if p != q:
                    return None
            else:
                total += e.costs[(p, q)]
        if self.memory_budget_bytes is not None:
            used = self.memory_constant_bytes + sum(c.memory_bytes for c in chosen.values())
            if used > self.memory_budget_bytes:
                return None
        return total


def _is_trivial(node: Node, graph: ModelGraph, num_tensor_inputs: int) -> bool:
    if node.target is operator.getitem:
        return True
    info = graph.nodes[node.name]
    if len(output_metas(node)) != 1 or num_tensor_inputs != 1:
        return False
    return info.op_class in ("view", "elementwise", "other")


@dataclass
class _Builder:
    """Mutable while the groups are collected; frozen into `LayerProblem` at the end."""

    graph: ModelGraph
    t: int
    device: DeviceSpec
    group_comm: CommGroup
    options: IntraOptions
    saved: frozenset[str]
    fx_nodes: dict[str, Node]
    owner: dict[str, str] = field(default_factory=dict)
    members: dict[str, list[str]] = field(default_factory=dict)
    kinds: dict[str, GroupKind] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    replicated_ops: list[tuple[str, str]] = field(default_factory=list)
    choices: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    edges: list[tuple[str, str, str, int]] = field(default_factory=list)

    @property
    def width(self) -> int | None:
        """Bytes per floating element at the options' precision (None: the traced dtype)."""
        p = self.options.precision
        return PRECISION_BYTES[p] if p else None

    def units(self, seconds: float) -> int:
        return round(seconds / self.options.unit_s)

    def act_bytes(self, node: Node, placement: Placement) -> float:
        if node.name not in self.saved:
            return 0.0
        meta = output_metas(node)[0]
        return self.options.micro_batch_size * local_bytes(meta, placement, self.t, self.width)

    def full_bytes(self, node: Node) -> float:
        """Whole-tensor bytes of node's output; activations scale with the micro-batch."""
        whole = local_bytes(output_metas(node)[0], Replicate(), self.t, self.width)
        is_param = self.graph.nodes[node.name].kind == "parameter"
        return whole if is_param else self.options.micro_batch_size * whole

    def reshard_s(self, node: Node, src: Placement, dst: Placement) -> float:
        return reshard_time_s(src, dst, self.full_bytes(node), self.t, self.group_comm)

    def new_group(
        self,
        name: str,
        kind: GroupKind,
        choices: list[dict[str, Any]],
        source: str = "",
        members: tuple[str, ...] | None = None,
    ) -> None:
        for c in choices:
            for key, default in _CHOICE_DEFAULTS.items():
                c.setdefault(key, default)
        self.owner[name] = name
        self.members[name] = list((name,) if members is None else members)
        self.kinds[name] = kind
        self.sources[name] = source
        self.choices[name] = choices

    def boundary(self, node: Node) -> Placement:
        """R, or S(seq) with sequence parallelism when the dim divides evenly."""
        meta = output_metas(node)[0]
        seq = self.options.sequence_dim
        if (
            self.options.sequence_parallel
            and len(meta.shape) > seq
            and not meta.shape[seq] % self.t
        ):
            return Shard(seq)
        return Replicate()

    def add_parameter(self, node: Node) -> None:
        meta = output_metas(node)[0]
        choices: list[dict] = []
        for p in candidate_placements(meta, self.t):
            if isinstance(p, (Replicate, Shard)):
                mem = self.options.param_memory_factor * local_bytes(meta, p, self.t, self.width)
                choices.append(
                    dict(
                        label=_text(p),
                        outputs={node.name: (p,)},
                        inputs=(),
                        memory_bytes=mem,
                    )
                )
        self.new_group(node.name, "parameter", choices)

    def add_input(self, node: Node) -> None:
        """A tensor from outside the layer: activations in the boundary placement, else R."""
        p = self.boundary(node) if self.graph.nodes[node.name].requires_grad else Replicate()
        outputs = {node.name: (p,)}
        choice = dict(label=_text(p), outputs=outputs, memory_bytes=self.act_bytes(node, p))
        self.new_group(node.name, "input", [dict(choice, inputs=())])

    def add_output(self, node: Node) -> None:
        """A sink: an activation leaves the layer in the boundary placement, a constant R."""
        p = self.boundary(node) if self.graph.nodes[node.name].requires_grad else Replicate()
        name = f"{node.name}:out"
        self.new_group(name, "output", [dict(label=_text(p), outputs={}, inputs=(p,))], members=())
        self.edges.append((self.owner[node.name], node.name, name, 0))

    def add_op(self, node: Node, ns: NodeStrategies, params: list[Node | None]) -> None:
        choices = []
        for s in ns.strategies:
            syncs, sync_s = [], 0.0
            if self.options.weight_grad_sync and (
                splits_work(s.outputs + s.inputs)
                or any(not isinstance(p, (Replicate, Shard)) for p in s.inputs)
            ):
                for param, p in zip(params, s.inputs, strict=True):
                    if param is not None and isinstance(p, Replicate):
                        nbytes = local_bytes(output_metas(param)[0], p, self.t, self.width)
                        sync_s += collective_time("all_reduce", nbytes, self.group_comm).time_s
                        syncs.append(param.name)
            choices.append(
                dict(
                    label=_strategy_text(s.outputs, s.inputs),
                    outputs={node.name: s.outputs},
                    inputs=s.inputs,
                    memory_bytes=self.act_bytes(node, s.outputs[0]),
                    compute_s=s.compute_s + s.backward_s,
                    comm_s=sync_s,
                    grad_syncs=tuple(syncs),
                )
            )
        self.new_group(node.name, "op", choices, ns.strategies[0].source)
        for k, src in enumerate(ns.inputs):
            self.edges.append((self.owner[src], src, node.name, k))

    def fold(self, node: Node, producer: str, ns: NodeStrategies | None) -> None:
        """`node` joins its producer's group and follows each of that group's choices."""
        root = self.owner[producer]
        self.owner[node.name] = root
        self.members[root].append(node.name)
        prod_node = self.fx_nodes[producer]
        for c in self.choices[root]:
            p_all = c["outputs"][producer]
            if ns is None:  # getitem(producer, k)
                c["outputs"] = {**c["outputs"], node.name: (p_all[node.args[1]],)}
                c["memory_bytes"] += self.act_bytes(node, p_all[node.args[1]])
                continue
            p = p_all[0]

            def price(s: Strategy, p: Placement = p) -> float:
                return 2 * self.reshard_s(prod_node, p, s.inputs[0]) + s.compute_s + s.backward_s

            # Follow: the strategy that takes p as it is; only when there is none, the
            # cheapest redistribution (never a free R -> S slice chosen for local gain only,
            # which would push an all-gather onto the consumers).
            same = [s for s in ns.strategies if s.inputs[0] == p]
            best = min(same or ns.strategies, key=price)
            c["outputs"] = {**c["outputs"], node.name: best.outputs}
            c["compute_s"] += best.compute_s + best.backward_s
            c["comm_s"] += 2 * self.reshard_s(prod_node, p, best.inputs[0])
            if best.inputs[0] != p:
                step = (producer, node.name, p, best.inputs[0], self.full_bytes(prod_node))
                c["internal"] = (*c["internal"], step)
            c["memory_bytes"] += self.act_bytes(node, best.outputs[0])


_CHOICE_DEFAULTS: dict[str, Any] = dict(
    memory_bytes=0.0, compute_s=0.0, comm_s=0.0, internal=(), grad_syncs=()
)


def _text(p: Placement) -> str:
    from autopar.solve.intra.strategies import describe

    return describe(p)


def _strategy_text(outputs: tuple[Placement, ...], inputs: tuple[Placement, ...]) -> str:
    return f"{','.join(map(_text, outputs))} <- {','.join(map(_text, inputs))}"


def build_problem(
    graph: ModelGraph,
    layer_name: str,
    t: int,
    device: DeviceSpec,
    group: CommGroup,
    options: IntraOptions,
) -> LayerProblem:
    """The `LayerProblem` of `layer_name` on t ranks (see the module docstring).

    Raises:
        KeyError: no such layer (the message lists the layers).
        ValueError: the graph has no `graph_module` to ask DTensor with.
    """
    layer = graph.layer(layer_name)
    if graph.graph_module is None:
        raise ValueError("the ModelGraph carries no graph_module; trace the model again")
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    in_layer = set(layer.nodes)
    saved = frozenset(layer.saved_values.get(options.recompute, ()))
    b = _Builder(graph, t, device, group, options, saved, fx_nodes)
    users: dict[str, list[str]] = {}
    for n in fx_nodes.values():
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n.name)
    for name in layer.nodes:
        node = fx_nodes[name]
        info = graph.nodes[name]
        if info.kind in ("parameter", "buffer"):
            b.add_parameter(node)
            continue
        if info.kind != "call" or not output_metas(node):
            continue  # _assert_tensor_metadata and other ops without a tensor result
        ins = tensor_inputs(node) if node.target is not operator.getitem else [node.args[0]]
        for a in ins:
            if a.name not in b.owner:
                if graph.nodes[a.name].kind in ("parameter", "buffer"):
                    b.add_parameter(a)
                else:
                    b.add_input(a)
        if node.target is operator.getitem:
            b.fold(node, node.args[0].name, None)
            continue
        params = [a if graph.nodes[a.name].kind == "parameter" else None for a in ins]
        ns = node_strategies(
            node,
            info,
            t,
            device,
            param_inputs=frozenset(i for i, p in enumerate(params) if p),
            batch_scale=options.micro_batch_size,
            precision=options.precision,
        )
        if ns.strategies[0].source == "replicated" and t > 1:
            b.replicated_ops.append((name, info.op))
        if _is_trivial(node, graph, len(ins)) and not options.no_folding:
            b.fold(node, ins[0].name, ns)
        else:
            b.add_op(node, ns, params)
    for name in layer.nodes:
        node = fx_nodes[name]
        if (
            name in b.owner
            and b.kinds[b.owner[name]] != "parameter"
            and any(u not in in_layer for u in users.get(name, ()))
        ):
            b.add_output(node)
    return _freeze(
        b, layer_name, fx_nodes, options, layer.saved_internal_bytes.get(options.recompute, 0.0)
    )


def _choice(b: _Builder, c: dict[str, Any]) -> Choice:
    # Integer units and whole bytes, so that the ILP and `evaluate` add the same numbers.
    cost = b.units(c["compute_s"] + c["comm_s"])
    return Choice(cost=cost, **{**c, "memory_bytes": math.ceil(c["memory_bytes"])})


def _freeze(
    b: _Builder,
    layer_name: str,
    fx_nodes: dict[str, Node],
    options: IntraOptions,
    internal_bytes: float,
) -> LayerProblem:
    groups = tuple(
        Group(
            name,
            b.kinds[name],
            tuple(b.members[name]),
            tuple(_choice(b, c) for c in b.choices[name]),
            b.sources[name],
        )
        for name in b.choices
    )
    by_name = {g.name: g for g in groups}
    edges = []
    for src, member, dst, k in b.edges:
        kind = "match" if b.kinds[src] == "parameter" else "reshard"
        node = fx_nodes[member]
        output_metas(node)[0]
        full = b.full_bytes(node)
        costs = {}
        if kind == "reshard":
            for p in {c.outputs[member][0] for c in by_name[src].choices}:
                for q in {c.inputs[k] for c in by_name[dst].choices}:
                    costs[(p, q)] = b.units(2 * b.reshard_s(node, p, q))
        edges.append(Edge(src, member, dst, k, kind, full, costs))
    return LayerProblem(
        layer_name,
        b.t,
        options.unit_s,
        groups,
        tuple(edges),
        options.memory_budget_bytes,
        math.ceil(options.micro_batch_size * internal_bytes),
        tuple(b.replicated_ops),
    )
