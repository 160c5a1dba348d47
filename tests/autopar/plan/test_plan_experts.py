"""A mixture-of-experts plan says how it priced the routing (`Plan.experts`): the parameters
a token passes through match the published active count, the summary names the experts per
rank and the load imbalance priced, and plan.json keeps it; a dense plan has none. A skewed
router (`CostOptions.moe_imbalance`) is priced on the busiest ep rank: its all-to-all bytes
and its expert matmuls scale by the factor, nothing else does."""

from __future__ import annotations

from collections import Counter

import pytest

import autopar
from autopar.models import hf, zoo
from cost_models.comm import flat_chunks


@pytest.fixture(scope="module")
def mixtral():
    model = hf.build("mixtral-8x7b")
    return model, autopar.trace(model, hf.example_inputs("mixtral-8x7b", model, seq_len=4096))


def _plan(mixtral, imbalance: float = 1.0) -> autopar.Plan:
    model, graph = mixtral
    cluster = autopar.Cluster.from_profile("dgx_h100", 2)
    config = autopar.ParallelConfig(dp=4, ep=4, pp=4, recompute="full")
    options = autopar.CostOptions(moe_imbalance=imbalance)
    return autopar.evaluate(
        model, cluster, config, graph=graph, global_batch_size=64, options=options
    )


def test_mixtral_plan_counts_its_active_parameters_and_states_its_routing_assumption(mixtral):
    plan = _plan(mixtral)
    e = plan.experts
    assert (e["moe_layers"], e["num_experts"], e["top_k"]) == (32, 8, 2)
    # Mixtral 8x7B: 46.7 B parameters, 12.9 B active per token (Jiang et al. 2024, section 2)
    assert e["active_params"] / 1e9 == pytest.approx(12.9, abs=0.05)
    line = next(x for x in plan.summary().splitlines() if x.startswith("  experts"))
    assert "32 MoE layers of 8 experts (2 per rank over ep=4), top 2: 12.9 B of 46.7 B" in line
    assert "load imbalance 1.00 priced (tokens spread evenly" in line
    assert autopar.Plan.from_json(plan.to_json()).experts == e


def test_a_skewed_router_is_priced_on_the_busiest_expert_rank(mixtral):
    even, skewed = _plan(mixtral), _plan(mixtral, 1.5)
    # the busiest rank's bytes, 1.5x: nearly bandwidth-bound at Mixtral's size (the latency
    # does not grow)
    assert 1.4 < skewed.breakdown["ep_comm"] / even.breakdown["ep_comm"] <= 1.5
    for key in ("tp_comm", "cp_comm", "dp_comm", "optimizer"):
        assert skewed.breakdown.get(key) == even.breakdown.get(key), key
    assert skewed.breakdown["compute_forward"] > even.breakdown["compute_forward"]
    assert skewed.stages[0].memory_bytes["activations"] > even.stages[0].memory_bytes["activations"]
    assert skewed.experts["imbalance"] == 1.5
    assert "load imbalance 1.50 priced (the busiest ep rank's" in skewed.summary()
    with pytest.raises(ValueError, match=r"moe_imbalance must be a finite number in \[1, 1024\]"):
        autopar.CostOptions(moe_imbalance=0.9)


def test_a_dense_plan_has_no_experts():
    model = zoo.build("llama-tiny")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    plan = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(dp=2), zoo.example_inputs("llama-tiny", model),
        global_batch_size=4,
    )  # fmt: skip
    assert plan.experts == {} and "experts" not in plan.summary()


def test_sequence_parallel_runs_the_experts_on_each_tp_ranks_sequence_shard(mixtral):
    """With SP each tp rank routes its own sequence shard (autopar.runtime.tp_apply,
    "token_sum"): the experts' activations and all-to-all rows halve at tp=2, and the routers'
    and this rank's experts' gradients are summed over tp, one flat buffer listed in its
    chunks."""
    model, graph = mixtral
    cluster = autopar.Cluster.from_profile("dgx_h100", 2)
    plans = [
        autopar.evaluate(
            model,
            cluster,
            autopar.ParallelConfig(dp=4, tp=2, ep=4, pp=2, recompute="full", sequence_parallel=sp),
            graph=graph,
            global_batch_size=64,
        )  # fmt: skip
        for sp in (False, True)
    ]
    whole, shards = plans
    assert shards.breakdown["ep_comm"] < 0.55 * whole.breakdown["ep_comm"]
    assert shards.breakdown["compute_forward"] < whole.breakdown["compute_forward"]
    summed = [c for c in shards.communication[0] if c["layer"] == "routers, experts"]
    assert {c["axis"] for c in summed} == {"tp"} and not any(
        c["layer"] == "routers, experts" for c in whole.communication[0]
    )
    # 16 layers a stage, 2 of the 8 experts (ep=4) at 3 x 4096 x 14336 each, and the routers
    # (4096 x 8 each), fp32 gradients: bf16 training keeps fp32 gradients (grad_bytes), one
    # flat buffer all-reduced in chunks (`flat_chunks`)
    experts = 16 * (2 * 3 * 4096 * 14336 + 4096 * 8)
    total = sum(c["bytes"] * c["count"] for c in summed)
    assert total == pytest.approx(experts * 4, rel=0.01)
    assert [(c["count"], c["bytes"]) for c in summed] == [
        (n, size) for size, n in Counter(flat_chunks(total)).items()
    ]
