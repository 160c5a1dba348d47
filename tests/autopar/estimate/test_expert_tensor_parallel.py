"""Expert tensor parallelism (etp = tp) from the config to the price, the space and the exporters.

etp is 1 (each expert whole on every tp rank) or tp (each expert's intermediate width split over
the tp ranks: `autopar.runtime.expert_tensor_parallel`). Priced: the experts' parameters and
FLOPs over ep x tp, their hidden-wide rows whole, Megatron's f/g collectives around the expert
call (with SP: gathers and reduce-scatters), the all-to-all carrying the tp group's tokens; the
experts out of SP's gradient sum. Searched where the runtime can split the experts, refused at
evaluate where it cannot, exported as Megatron's and torchtitan's ETP. The runtime's numerics
and the plan-equals-run check are in tests/autopar/runtime (test_numerics_cp_ep.py,
test_hf_expert_parallel.py, test_plan_fidelity.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.codegen.export import export_plan
from autopar.config.text import parse_config
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.communication import stage_communication
from autopar.estimate.memory import expert_params_on_rank, token_summed_params
from autopar.models import hf, zoo
from autopar.runtime.capability import expert_width, runtime_problems
from autopar.runtime.expert_tensor_parallel import expert_split_problem
from autopar.solve.limits import space_limits
from autopar.solve.space import inner_choices, shape_problems

ROUND = Path(__file__).with_name("round.toml")


@pytest.fixture(scope="module")
def moe():
    model = zoo.build("moe-tiny", device="meta")
    graph = autopar.trace(model, zoo.example_inputs("moe-tiny", model))
    return model, graph, build_tables(graph)


def test_etp_is_one_or_tp_and_round_trips_through_the_config_text():
    with pytest.raises(ConfigError, match="etp=2 must be 1 .* or tp=4"):
        ParallelConfig(tp=4, etp=2).validate()
    with pytest.raises(ConfigError, match="etp must be an integer >= 1, got 0"):
        ParallelConfig(tp=2, etp=0).validate()
    cfg = ParallelConfig(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True)
    assert "etp=2" in cfg.as_text() and parse_config(cfg.as_text()) == cfg
    assert cfg.to_dict()["etp"] == 2
    assert "etp" not in ParallelConfig(tp=2).to_dict()  # plans without it save as before


def test_split_experts_are_priced_over_ep_times_tp(moe):
    _, _, tables = moe
    layers = list(tables.layers)
    whole = ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True)
    split = replace(whole, etp=2)
    experts = sum(t.params_expert for t in layers)
    assert expert_params_on_rank(whole, layers) == experts / 2
    assert expert_params_on_rank(split, layers) == experts / 4
    # with SP whole experts on sequence shards have their gradients summed over tp; split
    # ones are each tp rank's own
    routers = sum(t.params_router for t in layers)
    assert token_summed_params(whole, layers) == routers + experts / 2
    assert token_summed_params(split, layers) == routers


def test_the_split_expert_collectives_are_megatrons_around_the_expert_call(moe):
    _, _, tables = moe
    moe_layers = [t for t in tables.layers if t.moe_num_experts]
    m = 3
    hidden = moe_layers[0].moe_hidden_bytes
    weights = moe_layers[0].moe_weights_bytes
    assert hidden and weights and not moe_layers[0].moe_index_bytes  # the zoo's [T, E] weights

    def etp(cfg):
        names = tuple(t.name for t in tables.layers)
        (stage,) = stage_communication(
            tables, cfg, [names], m, precision="fp32", grad_bytes=4, act_scale=1.0
        )
        calls: dict[tuple[str, float], int] = {}
        for c in stage:
            if c.part == "etp":
                calls[(c.kind, c.bytes)] = calls.get((c.kind, c.bytes), 0) + c.count
        return sorted((kind, nbytes, count) for (kind, nbytes), count in calls.items())

    n = len(moe_layers)
    assert etp(ParallelConfig(tp=2)) == []
    # f/g: the output all-reduced forward, the input's and routing weights' gradients backward
    assert etp(ParallelConfig(tp=2, etp=2)) == sorted(
        [("all_reduce", hidden, 2 * m * n), ("all_reduce", weights, m * n)]
    )
    # with full recompute the forward's all-reduce runs twice
    full = ParallelConfig(tp=2, etp=2, recompute="full")
    assert ("all_reduce", hidden, 3 * m * n) in etp(full)
    sp = etp(ParallelConfig(tp=2, etp=2, sequence_parallel=True))
    assert sp == sorted(
        [("all_gather", hidden, 2 * m * n), ("all_gather", weights, m * n),
         ("reduce_scatter", hidden, 2 * m * n), ("reduce_scatter", weights, m * n)]
    )  # fmt: skip


def test_split_experts_trade_collectives_for_memory_where_sequence_parallel_runs(moe):
    _, _, tables = moe
    e = Estimator(tables, Cluster.from_profile(ROUND, num_devices=4), options=CostOptions())
    whole = ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True)
    split = replace(whole, etp=2)
    a, b = e.evaluate(whole, 8), e.evaluate(split, 8)
    # the same expert FLOPs (a sequence shard through whole experts, or the group's tokens
    # through a slice) from half the weights: no more compute; more collectives over tp, less
    # parameter memory
    assert b.breakdown["compute_forward"] <= a.breakdown["compute_forward"]
    assert b.breakdown["tp_comm"] > a.breakdown["tp_comm"]
    assert b.stages[0].memory.parameters_bytes < a.stages[0].memory.parameters_bytes


def test_the_space_offers_split_experts_where_the_runtime_splits_them(moe):
    model, graph, _ = moe
    cluster = Cluster.from_profile("local_cpu", num_devices=4)
    lim = space_limits(model, graph, cluster, global_batch_size=8)
    limits, notes = autopar.runtime.capability.runtime_limits(model, lim)
    assert limits.expert_width == zoo.config("moe-tiny").expert_ffn_hidden
    etps = {c.etp for c in inner_choices(limits, (1, 1, 1, 2, 1, 1))}
    assert etps == {1, 2}
    assert {c.etp for c in inner_choices(limits, (2, 1, 1, 1, 2, 1))} == {1}  # tp = 1
    dense = zoo.build("llama-tiny", device="meta")
    dense_graph = autopar.trace(dense, zoo.example_inputs("llama-tiny", dense))
    dense_lim = space_limits(dense, dense_graph, cluster, global_batch_size=8)
    assert {c.etp for c in inner_choices(dense_lim, (1, 1, 1, 2, 1, 1))} == {1}
    assert shape_problems(ParallelConfig(tp=2, etp=2), dense_lim) == [
        "etp=2 splits experts over tp, but the model has no expert layers"
    ]


class _BiasedExperts(nn.Module):
    """A stack of transformers' layout with biases (as gpt-oss's): not Mixtral's."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))
        self.down_proj_bias = nn.Parameter(torch.zeros(4, 8))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_experts_the_runtime_cannot_split_are_refused_with_the_reason(moe):
    stack = _BiasedExperts()
    assert (
        expert_split_problem(stack) == "it holds down_proj_bias beside gate_up_proj and down_proj"
    )
    holder = nn.Module()
    holder.experts = stack
    width, why = expert_width(holder)
    assert width == 0 and why.startswith("experts (_BiasedExperts): it holds down_proj_bias")
    mixtral = hf.build("mixtral-tiny-hf", device="meta")
    assert expert_width(mixtral) == (mixtral.config.intermediate_size, "")
    dense = zoo.build("llama-tiny", device="meta")
    (problem,) = runtime_problems(dense, ParallelConfig(tp=2, etp=2), 2)
    assert problem == f"etp=2: {type(dense).__name__} has no MoE layer autopar's runtime dispatches"
    model, graph, _ = moe
    odd = ParallelConfig(tp=3, etp=3)
    assert runtime_problems(model, odd, 2) == [
        f"etp=3 does not divide the experts' intermediate width "
        f"{zoo.config('moe-tiny').expert_ffn_hidden} of MoE"
    ]


def test_exporters_carry_the_expert_layout(moe):
    model, graph, _ = moe
    cluster = Cluster.from_profile("dgx_h100", 1, devices_per_node=4)
    for etp in (1, 2):
        cfg = ParallelConfig(dp=2, tp=2, ep=2, etp=etp, sequence_parallel=True)
        plan = autopar.evaluate(model, cluster, cfg, global_batch_size=8, graph=graph)
        megatron = export_plan(plan, "megatron", None).text
        assert f"--expert-tensor-parallel-size {etp}" in megatron
        titan = export_plan(plan, "torchtitan", None)
        assert f"expert_tensor_parallel_degree = {etp}" in titan.text
        folded = any("folds ep over the tp ranks" in gap for gap in titan.gaps)
        assert folded == (etp == 1)
