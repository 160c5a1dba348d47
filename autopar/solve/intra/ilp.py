"""The intra-layer ILP on OR-Tools CP-SAT: one choice per group, minimum total cost.

In: a `LayerProblem` (problem.py). Out: a `Solution` (the pick per group, the objective in the
problem's integer units, the solver status and the model's size). Invariant: the objective of
the picks equals `LayerProblem.evaluate(picks)`; the brute-force tests check it is the minimum.

Variables and constraints, with G the groups, C_g the choices of g:

    x[g, c] in {0, 1},          sum_{c in C_g} x[g, c] = 1                 (one-hot per group)

For an edge from member a of group A into input k of group B, the placements decide the cost,
not the choices themselves, so the edge is linearised over placements (a transportation
polytope whose vertices are exactly the products of two one-hot vectors):

    y[p] = sum { x[A, c] : out_c(a) = p }        z[q] = sum { x[B, c] : in_c(k) = q }
    e[p, q] in {0, 1},   sum_q e[p, q] = y[p],   sum_p e[p, q] = z[q]
    edge cost = sum_{p, q} cost(p -> q) e[p, q]

Since sum_p y = sum_q z = 1, e is the indicator of the pair (p, q) that is chosen. That needs
|P| |Q| variables (at most ~ (ndim + 2)^2), not |C_A| |C_B|. An edge whose source or target
has one placement only is linear already (cost(p0 -> q) z[q]) and gets no e variables; an edge
whose costs are all zero is dropped. A "match" edge (parameter -> consumer) is z[q] <= y[q]:
the consumer may pick q only if the parameter is stored as q.

    objective = sum_g sum_c cost(c) x[g, c] + sum_edges edge cost
    memory:     sum_g sum_c memory(c) x[g, c] <= budget - constant        (if a budget is set)

Memory coefficients are rounded up to whole bytes. An infeasible model is answered with the
least memory any plan needs (a second solve that minimises memory), so the message names the
constraint that failed with its numbers.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autopar.solve.intra.problem import LayerProblem


@dataclass(frozen=True)
class Solution:
    picks: dict[str, int]  # group -> index of its choice
    objective: int | None  # units; None when infeasible
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    solve_time_s: float
    num_variables: int
    num_constraints: int
    infeasible_reason: str = ""


def _model(problem: LayerProblem) -> tuple[cp_model.CpModel, dict, list, list]:
    model = cp_model.CpModel()
    x: dict[str, list] = {}
    obj_terms: list = []
    mem_terms: list = []
    for g in problem.groups:
        if len(g.choices) == 1:
            x[g.name] = [1]
        else:
            x[g.name] = [model.new_bool_var(f"x[{g.name},{i}]") for i in range(len(g.choices))]
            model.add_exactly_one(x[g.name])
        for var, c in zip(x[g.name], g.choices, strict=False):
            if c.cost:
                obj_terms.append(c.cost * var)
            if c.memory_bytes:
                mem_terms.append(math.ceil(c.memory_bytes) * var)
    by_name = {g.name: g for g in problem.groups}
    for n, e in enumerate(problem.edges):
        y: dict = defaultdict(list)
        for var, c in zip(x[e.src], by_name[e.src].choices, strict=False):
            y[c.outputs[e.member][0]].append(var)
        z: dict = defaultdict(list)
        for var, c in zip(x[e.dst], by_name[e.dst].choices, strict=False):
            z[c.inputs[e.input]].append(var)
        if e.kind == "match":
            for q, zq in z.items():
                if q in y:
                    if len(z) > 1 or len(y) > 1:
                        model.add(sum(zq) <= sum(y[q]))
                else:
                    model.add(sum(zq) == 0)
            continue
        if not any(e.costs.values()):
            continue
        if len(y) == 1 or len(z) == 1:
            for p, yp in y.items():
                for q, zq in z.items():
                    cost = e.costs[(p, q)]
                    if cost:
                        obj_terms.append(cost * sum(zq if len(y) == 1 else yp))
            continue
        pair = {(p, q): model.new_bool_var(f"e{n}[{p},{q}]") for p in y for q in z}
        for p, yp in y.items():
            model.add(sum(pair[(p, q)] for q in z) == sum(yp))
        for q, zq in z.items():
            model.add(sum(pair[(p, q)] for p in y) == sum(zq))
        obj_terms += [e.costs[k] * v for k, v in pair.items() if e.costs[k]]
    return model, x, obj_terms, mem_terms


def _run(
    model: cp_model.CpModel, time_limit_s: float, num_workers: int
) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = 0
    return solver, solver.solve(model)


def solve_problem(
    problem: LayerProblem, time_limit_s: float = 10.0, num_workers: int = 1
) -> Solution:
    """Minimise the problem's cost with CP-SAT (see the module docstring).

    Returns:
        A Solution; status INFEASIBLE (with the memory numbers) when the budget cannot hold.
    """
    start = time.perf_counter()
    model, x, obj_terms, mem_terms = _model(problem)
    if problem.memory_budget_bytes is not None and mem_terms:
        cap = math.floor(problem.memory_budget_bytes - problem.memory_constant_bytes)
        model.add(sum(mem_terms) <= cap)
    model.minimize(sum(obj_terms))
    proto = model.proto
    num_vars, num_cons = len(proto.variables), len(proto.constraints)
    solver, status = _run(model, time_limit_s, num_workers)
    elapsed = time.perf_counter() - start
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        reason = ""
        if status == cp_model.INFEASIBLE:
            reason = _memory_reason(problem, time_limit_s, num_workers)
        return Solution({}, None, name, elapsed, num_vars, num_cons, reason)
    picks = {
        g: next(i for i, v in enumerate(vs) if isinstance(v, int) or solver.value(v))
        for g, vs in x.items()
    }
    return Solution(picks, round(solver.objective_value), name, elapsed, num_vars, num_cons)


def _memory_reason(problem: LayerProblem, time_limit_s: float, num_workers: int) -> str:
    model, _, _, mem_terms = _model(problem)
    model.minimize(sum(mem_terms))
    solver, status = _run(model, time_limit_s, num_workers)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "the layer has no consistent sharding even without a memory budget"
    least = solver.objective_value + problem.memory_constant_bytes
    return (
        f"memory: the budget of {problem.memory_budget_bytes / 2**20:.2f} MiB per rank is below "
        f"the least this layer needs on {problem.t} ranks, {least / 2**20:.2f} MiB "
        f"(parameters and saved activations)"
    )
