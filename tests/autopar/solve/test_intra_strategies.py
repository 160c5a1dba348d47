"""Strategies asked of DTensor, our own rules, the replicated fallback, and folding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.models import zoo
from autopar.solve.intra import IntraOptions, layer_problem
from autopar.solve.intra.strategies import describe, node_strategies


@pytest.fixture(scope="module")
def gpt():
    model = zoo.build("gpt-tiny")
    graph = autopar.trace(model, zoo.example_inputs("gpt-tiny", model))
    nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    return graph, nodes


@pytest.fixture(scope="module")
def device():
    return autopar.Cluster.from_profile("dgx_h100").profile.device


def _table(graph, nodes, name, t, device):
    ns = node_strategies(nodes[name], graph.nodes[name], t, device)
    return ns, {
        (tuple(map(describe, s.outputs)), tuple(map(describe, s.inputs))): s for s in ns.strategies
    }


def test_linear_gets_megatron_strategies_from_dtensors_decomposition(gpt, device):
    graph, nodes = gpt
    ns, table = _table(graph, nodes, "linear_2", 4, device)  # mlp.fc: x [1,32,64] @ W [256,64]
    assert {s.source for s in ns.strategies} == {"decomposition"}
    assert (("R",), ("R", "R", "R")) in table  # replicated
    assert (("S(2)",), ("R", "S(0)", "S(0)")) in table  # column parallel
    assert (("P(sum)",), ("S(2)", "S(1)", "P(sum)")) in table  # row parallel
    assert (("S(1)",), ("S(1)", "R", "R")) in table  # tokens split, weights replicated
    replicated = table[(("R",), ("R", "R", "R"))]
    column = table[(("S(2)",), ("R", "S(0)", "S(0)"))]
    assert column.compute_s < replicated.compute_s  # a quarter of the FLOPs


def test_attention_rule_shards_heads_and_respects_the_causal_mask(gpt, device):
    graph, nodes = gpt
    ns, table = _table(graph, nodes, "scaled_dot_product_attention", 4, device)
    assert {s.source for s in ns.strategies} == {"rule"}
    assert (("S(1)",), ("S(1)", "S(1)", "S(1)")) in table  # heads
    # causal: query rows cannot be split without the global offset of the mask
    assert not any(out == ("S(2)",) for out, _ in table)


def test_uneven_shards_are_dropped(gpt, device):
    graph, nodes = gpt
    _, table = _table(graph, nodes, "scaled_dot_product_attention", 8, device)  # 4 heads
    assert not any("S(1)" in out for out, _ in table)


@torch.library.custom_op("autopar_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x_BSH):
        return torch.ops.autopar_test.twice(self.fc(x_BSH)) + x_BSH


class _TwoOdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Odd(), _Odd()])

    def forward(self, x_BSH):
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return x_BSH


def test_an_op_nobody_can_shard_is_planned_replicated_and_listed():
    graph = autopar.trace(_TwoOdd(), (torch.randn(1, 8, 16),))
    cluster = autopar.Cluster.from_profile("dgx_h100")
    problem = layer_problem(graph, "blocks.0", cluster, 2, IntraOptions(no_folding=True))
    assert [op for _, op in problem.replicated_ops] == ["autopar_test.twice.default"]
    twice = next(g for g in problem.groups if g.name.startswith("twice"))
    assert [c.label for c in twice.choices] == ["R <- R"]
    plan = autopar.solve.intra.solve_layer(graph, "blocks.0", cluster, 2)
    assert plan.feasible and plan.replicated_ops
    assert "no sharding rule" in plan.as_text()


def test_folding_shrinks_the_ilp_and_keeps_every_node_placed(gpt):
    graph, _ = gpt
    cluster = autopar.Cluster.from_profile("dgx_h100")
    folded = layer_problem(graph, "blocks.0", cluster, 4, IntraOptions())
    unfolded = layer_problem(graph, "blocks.0", cluster, 4, IntraOptions(no_folding=True))
    # view, transposes x4, reshape, gelu (getitems always follow their split)
    assert len(folded.groups) == len(unfolded.groups) - 7
    members = {m for g in folded.groups for m in g.members}
    calls = {n for n in graph.layer("blocks.0").nodes if graph.nodes[n].kind == "call"}
    assert calls <= members
