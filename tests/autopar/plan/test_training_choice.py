"""parallelize chooses the training algorithm: DiLoCo across a slow link, synchronous on one site.

A 0.5 B Llama-shaped model, 256 sequences of 2,048 tokens: on 4 DGX H100 split over 2 sites
joined by 1 Gb/s, every synchronous layout pays the link each step (the gradient sum or a
pipeline hop), and DiLoCo -- each site a replica group on half the batch -- reaches the token
budget first even with its 5% more tokens; the plan returned is one site's. On the same
nodes in one building, nothing crosses a slow link and training stays synchronous. The
record survives plan.json, and summary() and explain() print it.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.estimate.algorithms import AlgorithmOptions, ft_step_cost
from autopar.models import zoo
from autopar.plan.check import plan_problems
from autopar.plan.training import with_training

SHAPE = dict(vocab_size=32000, seq_len=2048, num_layers=8, hidden=2048, ffn_hidden=5632)
SHAPE |= dict(num_heads=16, num_kv_heads=8)


@pytest.fixture(scope="module")
def model_and_ids():
    model = zoo.build("llama-tiny", device="meta", **SHAPE)
    (ids,) = zoo.example_inputs("llama-tiny", model)
    return model, ids


def plan_on(model_and_ids, cluster, **algorithms):
    model, ids = model_and_ids
    options = autopar.PlanOptions(sensitivity=False, algorithms=AlgorithmOptions(**algorithms))
    return autopar.parallelize(model, cluster, (ids,), global_batch_size=256, options=options)


def test_diloco_across_a_slow_link_synchronous_in_one_building(model_and_ids):
    split = autopar.Cluster.from_profile("dgx_h100", 4, sites=2, site_link_gbps=1)
    plan = plan_on(model_and_ids, split)
    t = plan.training
    assert t["chosen"]["name"] == "diloco" and t["chosen"]["replicas"] == 2
    assert plan.world_size == 16 and plan.global_batch_size == 128  # one site's group
    sync = next(c for c in t["candidates"] if c["name"] == "sync")
    assert sync["time_to_budget_s"] > t["chosen"]["time_to_budget_s"]
    # the synchronous layout moves more across the link each step than DiLoCo's 1/H
    assert sync["cross_site_bytes_per_step"] > t["chosen"]["cross_site_bytes_per_step"]
    assert t["token_budget"] == pytest.approx(20 * plan.num_params)
    assert t["chosen"]["token_multiplier"] == pytest.approx(1.05)
    assert "DiLoCo" in plan.summary() and "Convergence: assumed" in plan.explain()
    assert any("--diloco-group G" in n for n in plan.notes)
    # the record survives the plan file, and the file's checks accept it
    assert autopar.Plan.from_json(plan.to_json()).training == t
    assert plan_problems(json.loads(plan.to_json())) == []

    one = plan_on(model_and_ids, autopar.Cluster.from_profile("dgx_h100", 4))
    assert one.training["chosen"]["name"] in ("sync", "ft")  # synchronous steps

    assert all(c["name"] != "diloco" for c in one.training["candidates"])
    assert all(c["cross_site_bytes_per_step"] == 0 for c in one.training["candidates"])


def test_choose_sync_keeps_the_whole_cluster(model_and_ids):
    split = autopar.Cluster.from_profile("dgx_h100", 4, sites=2, site_link_gbps=1)
    plan = plan_on(model_and_ids, split, choose="sync")
    assert plan.training["chosen"]["name"] == "sync"
    assert plan.world_size == 32 and plan.global_batch_size == 256
    assert all(c["name"] != "diloco" for c in plan.training["candidates"])


def test_fault_tolerant_groups_pay_torchfts_step_cost(model_and_ids):
    """The ft candidate steps slower than the synchronous one by torchft's own work: the
    gradient all-reduce over the groups after the backward (less what the synchronous step
    exposed of its gradient sync) and the quorum and commit."""
    model, ids = model_and_ids
    cluster = autopar.Cluster.from_profile("dgx_h100", 4)
    cfg = autopar.ParallelConfig(dp=4, fsdp=8, zero_stage=3)
    plan = autopar.evaluate(model, cluster, cfg, (ids,), global_batch_size=256)
    plan = with_training(plan, None, cluster, AlgorithmOptions(), None)
    by_name = {c["name"]: c for c in plan.training["candidates"]}
    rel = cluster.profile.reliability
    grads = max(s.memory_bytes["gradients"] for s in plan.stages)
    cost, reduce = ft_step_cost(plan.config, cluster, grads, plan.breakdown["dp_comm"],
                                rel.ft_control_s)  # fmt: skip
    assert by_name["ft"]["extra"]["torchft_step_s"] == pytest.approx(cost)
    assert cost > rel.ft_control_s and reduce > plan.breakdown["dp_comm"]  # the hidden part
    assert by_name["ft"]["step_time_s"] == pytest.approx(plan.step_time_s + cost)


def test_a_plan_over_sites_records_them_and_replan_keeps_them():
    """A plan priced over two sites names them in its cluster fingerprint (the same nodes in
    one building are another cluster), its file's check accepts it and refuses it with the
    link changed, naming the sites; replan prices the new size over the same sites."""
    model = zoo.build("gpt-tiny", device="meta")
    inputs = zoo.example_inputs("gpt-tiny", model)
    sync = autopar.PlanOptions(sensitivity=False, algorithms=AlgorithmOptions(choose="sync"))
    split = autopar.Cluster.from_profile("dgx_h100", 2, sites=2, site_link_gbps=1)
    plan = autopar.parallelize(model, split, inputs, global_batch_size=64, options=sync)
    one = autopar.parallelize(model, autopar.Cluster.from_profile("dgx_h100", 2), inputs,
                              global_batch_size=64, options=sync)  # fmt: skip
    assert plan.cluster_fingerprint != one.cluster_fingerprint
    data = json.loads(plan.to_json())
    assert plan_problems(data) == []
    data["training"]["site_link_gbps"] = 2.0
    (problem,) = plan_problems(data)
    assert "over 2 sites joined by 2 Gb/s" in problem and "not the cluster" in problem
    bigger = autopar.replan(plan, num_nodes=4, options=sync)
    assert bigger.world_size == 32 and bigger.training["sites"] == 2
    assert bigger.training["site_link_gbps"] == pytest.approx(1.0)
    assert plan_problems(json.loads(bigger.to_json())) == []
