"""What the intra-layer ILP finds on its own: Megatron TP, replication, memory-driven sharding."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import zoo
from autopar.solve.intra import IntraLayerCache, IntraOptions, solve_layer

MiB = 2**20


@pytest.fixture(scope="module")
def llama_70b_shape():
    # Llama 3 70B's layer shape (hidden 8192, 64 heads, 8 KV heads, FFN 28672), seq 4096, meta.
    model = zoo.build(
        "llama-tiny", device="meta", hidden=8192, num_heads=64, num_kv_heads=8,
        ffn_hidden=28672, seq_len=4096, num_layers=2,
    )  # fmt: skip
    return autopar.trace(model, zoo.example_inputs("llama-tiny", model))


@pytest.fixture(scope="module")
def llama_tiny():
    model = zoo.build("llama-tiny")
    return autopar.trace(model, zoo.example_inputs("llama-tiny", model))


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_large_hidden_on_nvlink_is_megatron_tensor_parallelism(llama_70b_shape, sequence_parallel):
    cluster = autopar.Cluster.from_profile("dgx_h100")
    plan = solve_layer(llama_70b_shape, "layers.0", cluster, 8, sequence_parallel=sequence_parallel)
    assert plan.status == "OPTIMAL", plan.as_text()
    weights = {k.split(".")[-2]: v for k, v in plan.parameter_placements.items()}
    assert {weights[name] for name in COLUMN} == {"S(0)"}, plan.as_text()
    assert {weights[name] for name in ROW} == {"S(1)"}, plan.as_text()
    assert plan.placements["scaled_dot_product_attention"] == ("S(1)",)  # by heads
    # The activations' collectives (ignoring the 16 KiB of RMSNorm statistics): two all-reduces
    # per layer, or each split into its reduce-scatter + all-gather halves (equal cost on a
    # ring; the ILP takes the split when the ops in between then run on 1/8 of the tokens).
    counts = plan.collective_counts(min_bytes=MiB)
    reductions = counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0)
    gathers = counts.get("all_reduce", 0) + counts.get("all_gather", 0)
    assert (reductions, gathers) == (2, 2), plan.as_text()
    assert set(counts) <= {"all_reduce", "reduce_scatter", "all_gather"}
    if sequence_parallel:
        assert counts == {"all_gather": 2, "reduce_scatter": 2}
    assert plan.solve_time_s < 5
    assert "S(0)" in plan.as_text()


def test_tiny_hidden_on_a_slow_interconnect_stays_replicated(llama_tiny):
    cluster = autopar.Cluster.from_profile("local_cpu")  # gloo over loopback, 50 us a message
    plan = solve_layer(llama_tiny, "layers.0", cluster, 2)
    assert set(plan.parameter_placements.values()) == {"R"}, plan.as_text()
    assert plan.collectives == ()
    assert plan.communication_s == 0


def test_a_memory_budget_below_the_replicated_weights_makes_it_shard(llama_tiny):
    cluster = autopar.Cluster.from_profile("local_cpu")
    free = solve_layer(llama_tiny, "layers.0", cluster, 2)
    budget = free.memory_bytes - 0.4 * free.parameter_bytes
    tight = solve_layer(llama_tiny, "layers.0", cluster, 2, memory_budget_bytes=budget)
    assert tight.status == "OPTIMAL"
    assert tight.memory_bytes <= budget < free.memory_bytes
    assert any(p.startswith("S(") for p in tight.parameter_placements.values()), tight.as_text()
    assert tight.objective > free.objective  # sharding costs time here; memory forced it
    impossible = solve_layer(llama_tiny, "layers.0", cluster, 2, memory_budget_bytes=1024)
    assert impossible.status == "INFEASIBLE"
    assert "memory" in impossible.infeasible_reason and "MiB" in impossible.as_text()


def test_plans_are_cached_per_layer_class_and_options(llama_tiny):
    cluster = autopar.Cluster.from_profile("dgx_h100")
    cache = IntraLayerCache()
    first = solve_layer(llama_tiny, "layers.0", cluster, 2, cache=cache)
    assert solve_layer(llama_tiny, "layers.1", cluster, 2, cache=cache) is first  # same class
    solve_layer(llama_tiny, "layers.0", cluster, 2, sequence_parallel=True, cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)


def test_tp_one_is_all_replicated(llama_tiny):
    cluster = autopar.Cluster.from_profile("dgx_h100")
    plan = solve_layer(llama_tiny, "layers.0", cluster, 1, options=IntraOptions(num_workers=1))
    assert set(plan.parameter_placements.values()) == {"R"} and plan.collectives == ()
    with pytest.raises(ValueError, match="tp must be"):
        solve_layer(llama_tiny, "layers.0", cluster, 0)


@pytest.mark.slow
def test_hugging_face_llama3_70b_layer_is_megatron_too():
    pytest.importorskip("transformers")
    from autopar.models import hf

    model = hf.build("llama3-70b", num_hidden_layers=2)  # meta device; ~5 s to trace
    graph = autopar.trace(model, hf.example_inputs("llama3-70b", model, seq_len=4096))
    cluster = autopar.Cluster.from_profile("dgx_h100")
    plan = solve_layer(graph, "model.layers.0", cluster, 8, sequence_parallel=True)
    weights = {k.split(".")[-2]: v for k, v in plan.parameter_placements.items()}
    assert {weights[name] for name in COLUMN} == {"S(0)"}, plan.as_text()
    assert {weights[name] for name in ROW} == {"S(1)"}, plan.as_text()
    assert plan.collective_counts(min_bytes=MiB) == {"all_gather": 2, "reduce_scatter": 2}
