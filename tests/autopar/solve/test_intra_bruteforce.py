"""The intra-layer ILP against brute force: same integer costs, same optimum.

Brute force enumerates every combination of the decision groups' choices; a parameter's choice
is read off its consumer's requirement (any other parameter choice breaks a "match" edge, so
enumerating it would only add infeasible points), and `LayerProblem.evaluate` prices each
point with the same integer costs the ILP minimises.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.models import zoo
from autopar.solve.intra import IntraOptions, layer_problem
from autopar.solve.intra.ilp import solve_problem
from autopar.solve.intra.problem import Choice, Edge, Group, LayerProblem


def brute_force(problem: LayerProblem) -> int | None:
    """Minimum of `problem.evaluate` over every combination (parameters follow consumers)."""
    free = [g for g in problem.groups if g.kind != "parameter" and len(g.choices) > 1]
    params = [g for g in problem.groups if g.kind == "parameter"]
    match = [e for e in problem.edges if e.kind == "match"]
    best = None
    for combo in itertools.product(*(range(len(g.choices)) for g in free)):
        picks = {g.name: i for g, i in zip(free, combo, strict=True)}
        chosen = {g.name: g.choices[picks.get(g.name, 0)] for g in problem.groups}
        for g in params:
            wanted = {chosen[e.dst].inputs[e.input] for e in match if e.src == g.name}
            options = [i for i, c in enumerate(g.choices) if {c.outputs[g.name][0]} >= wanted]
            picks[g.name] = options[0] if options else 0
        # With a memory budget a parameter may still choose among equal placements: none here
        # (one consumer each), so the derived pick is the only feasible one.
        value = problem.evaluate(picks)
        if value is not None and (best is None or value < best):
            best = value
    return best


def restrict(problem: LayerProblem, keep: dict[str, int], seed: int = 0) -> LayerProblem:
    """Keep choice 0 (all-replicated) and up to keep[name] - 1 random others per op group."""
    rng = random.Random(seed)
    groups = []
    for g in problem.groups:
        k = keep.get(g.name, 1) if g.kind == "op" else len(g.choices)
        if len(g.choices) > k:
            others = sorted(rng.sample(range(1, len(g.choices)), k - 1))
            g = dataclasses.replace(g, choices=tuple(g.choices[i] for i in [0, *others]))
        groups.append(g)
    return dataclasses.replace(problem, groups=tuple(groups))


def check(problem: LayerProblem) -> int | None:
    solution = solve_problem(problem, time_limit_s=20, num_workers=4)
    reference = brute_force(problem)
    if reference is None:
        assert solution.status == "INFEASIBLE"
        return None
    assert solution.status == "OPTIMAL"
    assert problem.evaluate(solution.picks) == solution.objective
    assert reference == solution.objective
    return solution.objective


# ---------------------------------------------------------------- synthetic problems


def _random_problem(seed: int) -> LayerProblem:
    """A chain-and-skip DAG of op groups with random placements and integer costs."""
    rng = random.Random(seed)
    placements = [Replicate(), Shard(0), Shard(1)]
    groups, edges = [], []
    for i in range(7):
        choices = tuple(
            Choice(
                label=f"c{j}",
                cost=rng.randrange(0, 100),
                outputs={f"n{i}": (rng.choice(placements),)},
                inputs=tuple(rng.choice(placements) for _ in range(2 if i else 0)),
                memory_bytes=rng.randrange(0, 50),
            )
            for j in range(rng.randrange(1, 5))
        )
        groups.append(Group(f"n{i}", "op", (f"n{i}",), choices))
        for k, src in enumerate(sorted({i - 1, rng.randrange(0, i)}) if i else []):
            costs = {
                (p, q): rng.randrange(0, 60) * (p != q) for p in placements for q in placements
            }
            edges.append(Edge(f"n{src}", f"n{src}", f"n{i}", k, "reshard", 1.0, costs))
    return LayerProblem("synthetic", 2, 1e-9, tuple(groups), tuple(edges), None, 0.0)


@pytest.mark.parametrize("seed", range(8))
def test_random_problems_equal_brute_force(seed):
    problem = _random_problem(seed)
    check(problem)
    # Memory budgets from the least to the most any plan can use must agree too.
    least = sum(min(c.memory_bytes for c in g.choices) for g in problem.groups)
    most = sum(max(c.memory_bytes for c in g.choices) for g in problem.groups)
    for fraction in (0.0, 0.3, 0.7):
        budget = least + fraction * (most - least)
        assert check(dataclasses.replace(problem, memory_budget_bytes=budget)) is not None
    assert check(dataclasses.replace(problem, memory_budget_bytes=least - 1)) is None


# ---------------------------------------------------------------- real layer graphs


class _MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x_BSH):
        return x_BSH + self.fc2(torch.relu(self.fc1(x_BSH)))


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_MLPBlock(), _MLPBlock()])

    def forward(self, x_BSH):
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return x_BSH


@pytest.fixture(scope="module")
def h100():
    return autopar.Cluster.from_profile("dgx_h100")


def test_mlp_block_equals_brute_force(h100):
    graph = autopar.trace(_TwoBlocks(), (torch.randn(1, 32, 64),))
    for tp, options in [(4, IntraOptions()), (2, IntraOptions(sequence_parallel=True))]:
        problem = layer_problem(graph, "blocks.0", h100, tp, options)
        assert len([g for g in problem.groups if g.kind == "op"]) >= 3  # fc1, fc2, add
        check(problem)


@pytest.fixture(scope="module")
def gpt_graph():
    model = zoo.build("gpt-tiny")
    return autopar.trace(model, zoo.example_inputs("gpt-tiny", model))


@pytest.fixture(scope="module")
def llama_graph():
    model = zoo.build("llama-tiny", num_kv_heads=4)
    return autopar.trace(model, zoo.example_inputs("llama-tiny", model))


def test_gpt_block_with_folding_equals_brute_force(gpt_graph, h100):
    problem = layer_problem(gpt_graph, "blocks.0", h100, 4, IntraOptions())
    folded = sum(len(g.members) - 1 for g in problem.groups)
    assert folded >= 8  # views, split/getitems, transposes, gelu
    ops = [g.name for g in problem.groups if g.kind == "op"]
    # three choices for 8 of the 10 op groups (6561 points), the two layer norms replicated
    check(restrict(problem, {name: 3 for name in ops if not name.startswith("layer_norm")}))


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_block_with_folding_equals_brute_force(llama_graph, h100, seed):
    problem = layer_problem(llama_graph, "layers.0", h100, 2, IntraOptions())
    ops = [g.name for g in problem.groups if g.kind == "op"]
    rng = random.Random(seed)
    keep = {name: 2 for name in rng.sample(ops, 12)}  # 2^12 points, the rest replicated
    check(restrict(problem, keep, seed))


def test_memory_budget_equals_brute_force(gpt_graph, h100):
    problem = layer_problem(gpt_graph, "blocks.0", h100, 4, IntraOptions())
    ops = [g.name for g in problem.groups if g.kind == "op"]
    small = restrict(problem, {name: 3 for name in ops if not name.startswith("layer_norm")}, 1)
    free = check(small)
    solution = solve_problem(small)
    used = small.memory_constant_bytes + sum(
        g.choices[solution.picks[g.name]].memory_bytes for g in small.groups
    )
    tight = dataclasses.replace(small, memory_budget_bytes=used * 0.9)
    assert check(tight) > free  # the budget binds, and the ILP still finds brute force's best
