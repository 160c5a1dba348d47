"""A mixture-of-experts plan says how it priced the routing (`Plan.experts`): the parameters
a token passes through match the published active count, the summary names the experts per
rank and the load-imbalance assumption, and plan.json keeps it; a dense plan has none."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import hf, zoo


def test_mixtral_plan_counts_its_active_parameters_and_states_its_routing_assumption():
    model = hf.build("mixtral-8x7b")
    inputs = hf.example_inputs("mixtral-8x7b", model, seq_len=4096)
    cluster = autopar.Cluster.from_profile("dgx_h100", 2)
    config = autopar.ParallelConfig(dp=4, ep=4, pp=4, recompute="full")
    plan = autopar.evaluate(model, cluster, config, inputs, global_batch_size=64)
    e = plan.experts
    assert (e["moe_layers"], e["num_experts"], e["top_k"]) == (32, 8, 2)
    # Mixtral 8x7B: 46.7 B parameters, 12.9 B active per token (Jiang et al. 2024, section 2)
    assert e["active_params"] / 1e9 == pytest.approx(12.9, abs=0.05)
    line = next(x for x in plan.summary().splitlines() if x.startswith("  experts"))
    assert "32 MoE layers of 8 experts (2 per rank over ep=4), top 2: 12.9 B of 46.7 B" in line
    assert "load imbalance 1.00" in line and "not priced" in line
    assert autopar.Plan.from_json(plan.to_json()).experts == e


def test_a_dense_plan_has_no_experts():
    model = zoo.build("llama-tiny")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    plan = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(dp=2), zoo.example_inputs("llama-tiny", model),
        global_batch_size=4,
    )  # fmt: skip
    assert plan.experts == {} and "experts" not in plan.summary()
