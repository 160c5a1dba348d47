"""parallelize(): the search against exhaustive enumeration, rediscovery of known plans, errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import Cluster, InfeasibleError
from autopar.estimate import Estimator, build_tables
from autopar.models import zoo
from autopar.solve import PlanOptions
from autopar.solve.limits import attention_heads
from autopar.solve.space import (
    SpaceLimits,
    axis_orders,
    degree_choices,
    inner_choices,
    recompute_layer_choices,
)


def _traced(name: str, **overrides):
    model = zoo.build(name, device="meta", **overrides)
    graph = autopar.trace(model, zoo.example_inputs(name, model))
    return model, graph


@pytest.fixture(scope="module")
def gpt():
    return _traced("gpt-tiny", num_layers=4)


@pytest.mark.parametrize(
    ("profile", "num_nodes"), [("dgx_h100", 1), ("dgx_a100_40g", 1), ("dgx_h100", 2)]
)
def test_search_equals_exhaustive_enumeration(gpt, profile, num_nodes):
    # 2 nodes of 4: axis orders differ in which groups cross the node (one node: all alike)
    model, graph = gpt
    cluster = Cluster.from_profile(profile, num_nodes, devices_per_node=8 // num_nodes)
    plan = autopar.parallelize(model, cluster, global_batch_size=32, graph=graph)
    estimator = Estimator(build_tables(graph), cluster, options=PlanOptions().cost)  # the same
    limits = SpaceLimits(
        world_size=8,
        devices_per_node=8 // num_nodes,
        num_blocks=4,
        num_heads=attention_heads(graph),
        seq_len=graph.input_shapes[0][-1],
        num_experts=0,
        global_batch_size=32,
    )
    best = None
    count = 0
    for cfg in _every_config(limits):  # every config, per-layer recompute too, nothing pruned
        est = estimator.evaluate(cfg, 32)
        count += 1
        if est.peak_memory_bytes <= cluster.profile.device.memory_bytes and (
            best is None or est.step_time_s < best.step_time_s
        ):
            best = est
    assert count > 500
    assert plan.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert plan.report["num_configs"] == count
    equivalent = plan.report["pruned"].get("equivalent axis order (same groups on the levels)", 0)
    reordered = sum(cfg.axis_order is not None for cfg in _every_config(limits))
    # one node: every order's groups lie inside it; two: some orders put other axes across
    assert (equivalent == reordered) if num_nodes == 1 else (0 < equivalent < reordered)


def _every_config(limits: SpaceLimits):
    """The whole space: every axis order of inner_choices and, per recompute policy, every
    recompute_layers k."""
    for degrees in degree_choices(limits):
        for order in axis_orders(degrees):
            for cfg in inner_choices(limits, degrees, order):
                yield cfg
                for k in recompute_layer_choices(limits, cfg):
                    yield replace(cfg, recompute_layers=k)


def test_model_that_fits_gets_plain_data_parallelism(gpt):
    model, graph = gpt
    plan = autopar.parallelize(
        model, Cluster.from_profile("dgx_h100"), global_batch_size=64, graph=graph
    )
    cfg = plan.config
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.cp) == (8, 1, 1, 1) and cfg.zero_stage == 0
    assert plan.alternatives and all("why" in a for a in plan.alternatives)


def test_tight_memory_gets_sharded_data_parallelism():
    # 1.3B parameters on 8 A100 40GB: replicated AdamW state (16 B/param = 21 GB) plus
    # activations does not fit; sharding the state over the data-parallel ranks does.
    model, graph = _traced("gpt-1.3b", num_layers=24, seq_len=2048)
    cluster = Cluster.from_profile("dgx_a100_40g")
    plan = autopar.parallelize(model, cluster, global_batch_size=64, graph=graph)
    cfg = plan.config
    assert cfg.zero_stage > 0 or cfg.tp > 1 or cfg.pp > 1
    assert plan.peak_memory_bytes <= cluster.profile.device.memory_bytes


def test_infeasible_model_names_the_memory_and_the_cluster_that_would_hold_it():
    model, graph = _traced("llama-7b", num_layers=32)
    cluster = Cluster.from_profile("local_cpu", num_devices=2)
    with pytest.raises(InfeasibleError) as err:
        autopar.parallelize(model, cluster, global_batch_size=2, graph=graph)
    message = str(err.value)
    assert "fits nowhere on local_cpu" in message
    assert "GiB per device" in message
    assert "nodes" in message


def test_plans_are_deterministic(gpt):
    model, graph = gpt
    cluster = Cluster.from_profile("dgx_h100")
    a = autopar.parallelize(model, cluster, global_batch_size=32, graph=graph)
    b = autopar.parallelize(model, cluster, global_batch_size=32, graph=graph)
    assert a.to_json() == b.to_json()
    assert a.timings["search"] > 0  # wall clock is kept, but out of the saved plan


@pytest.mark.slow
def test_mixture_of_experts_gets_expert_parallelism():
    # 64 experts, top-2, 13B parameters on 16 H100: fully sharding the experts would gather
    # all 64 experts' weights every micro-batch while each token uses two of them; splitting
    # the experts over ranks moves only the tokens.
    model, graph = _traced(
        "moe-tiny", num_experts=64, top_k=2, hidden=4096, num_heads=16, num_kv_heads=4,
        ffn_hidden=16384, expert_ffn_hidden=8192, num_layers=2, seq_len=4096,
    )  # fmt: skip
    plan = autopar.parallelize(
        model, Cluster.from_profile("dgx_h100", num_nodes=2), global_batch_size=256, graph=graph
    )
    assert plan.config.ep > 1


@pytest.mark.slow
def test_very_long_sequences_get_context_parallelism():
    model, graph = _traced("llama-8b", num_layers=2, seq_len=131072)
    plan = autopar.parallelize(
        model, Cluster.from_profile("dgx_h100"), global_batch_size=8, graph=graph
    )
    assert plan.config.cp > 1


def test_deep_model_on_a_slow_network_gets_pipeline_parallelism(tmp_path):
    # round.toml with a 0.1 GB/s network between nodes: gradients cannot cross it every step,
    # one micro-batch's activations can.
    from pathlib import Path

    text = (Path(__file__).parents[1] / "estimate" / "round.toml").read_text()
    slow = tmp_path / "slow.toml"
    slow.write_text(text.replace("bandwidth_bytes_per_s = 10e9", "bandwidth_bytes_per_s = 0.1e9"))
    model, graph = _traced("gpt-tiny", num_layers=16, hidden=512, num_heads=8, seq_len=256)
    cluster = Cluster.from_profile(slow, num_nodes=2)
    plan = autopar.parallelize(model, cluster, global_batch_size=64, graph=graph)
    assert plan.config.pp > 1


def test_time_limit_returns_the_best_found_and_says_so(gpt):
    model, graph = gpt
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2)
    full = autopar.parallelize(model, cluster, global_batch_size=32, graph=graph)
    cut = autopar.parallelize(
        model,
        cluster,
        global_batch_size=32,
        graph=graph,
        options=autopar.PlanOptions(time_limit_s=0.0),  # stop after the first fitting choice
    )
    assert cut.report["num_unsearched"] > 0
    assert 0 < cut.report["optimality_gap"] < 1
    assert any("stopped at its time limit" in n for n in cut.notes)
    assert "STOPPED at the time limit" in cut.report["text"]
    # the plan found is no better than the full search's, and within the stated gap
    assert cut.step_time_s >= full.step_time_s
    assert cut.step_time_s * (1 - cut.report["optimality_gap"]) <= full.step_time_s
    assert full.report["num_unsearched"] == 0


def test_a_stack_that_shards_over_cp_is_offered_zero_over_the_cp_ranks_alone():
    """fsdp = 1, cp > 1 with ZeRO: torchtitan's layout at long sequences (dp_shard 1 under cp),
    offered where the stack shards over cp and not on autopar's own runtime, which does not."""
    limits = SpaceLimits(
        world_size=8, devices_per_node=8, num_blocks=4, num_heads=32, seq_len=131072,
        num_experts=0, global_batch_size=8,
    )  # fmt: skip
    degrees = (1, 1, 8, 1, 1, 1)
    assert {c.zero_stage for c in inner_choices(limits, degrees)} == {0}
    over = replace(limits, zero_over_cp=True)
    assert {c.zero_stage for c in inner_choices(over, degrees)} == {0, 1, 2, 3}
    model, graph = _traced("llama-8b", num_layers=4, seq_len=131072)
    cluster = Cluster.from_profile("dgx_h100")
    plans = {
        stack: autopar.parallelize(model, cluster, global_batch_size=8, graph=graph, stack=stack)
        for stack in ("torchtitan", "autopar")
    }
    titan, own = plans["torchtitan"].config, plans["autopar"].config
    # 131k tokens on one node: cp = 8 either way; torchtitan shards the optimizer over it
    # instead of recomputing, autopar's runtime keeps zero 0
    assert (titan.cp, titan.fsdp, own.cp) == (8, 1, 8)
    assert titan.zero_stage > 0 and own.zero_stage == 0
