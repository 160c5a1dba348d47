"""Pipelines whose stages have meshes and cuts of their own (`Estimator.evaluate_stages`).

Uniform stages price exactly as `Estimator.evaluate` prices the same config; a stage of its own
tp prices as that tp's uniform config prices its stage; a layer cut between two stages costs
each its share; bad stages are refused naming what is wrong; Aceso's shipped plans map onto
the model's layers once each."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar.estimate import Estimator, StageMesh, StagePart, build_tables, load_stack

ROOT = Path(__file__).resolve().parents[3]
BATCH, MICRO = 16, 2


@pytest.fixture(scope="module")
def tables():
    from autopar.models import zoo

    model = zoo.build("gpt-tiny", device="meta", num_layers=4, hidden=512, num_heads=8,
                      seq_len=512)  # fmt: skip
    return build_tables(autopar.trace(model, zoo.example_inputs("gpt-tiny", model)))


def _estimator(tables, devices: int) -> Estimator:
    cluster = autopar.Cluster.from_profile("dgx_a100_40g", num_devices=devices)
    return Estimator(tables, cluster, options=load_stack("megatron-lm").options)


def _meshes(estimate, tp: int, recompute: float) -> list[StageMesh]:
    return [
        StageMesh(
            tuple(
                StagePart(n, 1.0, recompute if n.startswith("blocks") else 0.0)
                for n in stage.layers
            ),
            tp=tp,
        )  # fmt: skip
        for stage in estimate.stages
    ]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_uniform_stages_price_as_the_uniform_config(tables, tp, policy):
    estimator = _estimator(tables, 2 * tp)
    cfg = autopar.ParallelConfig(pp=2, tp=tp, micro_batch_size=MICRO, recompute=policy)
    want = estimator.evaluate(cfg, BATCH)
    got = estimator.evaluate_stages(_meshes(want, tp, float(policy == "full")), BATCH, MICRO)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert got.peak_memory_bytes == pytest.approx(want.peak_memory_bytes, rel=1e-12)
    for key, value in want.breakdown.items():
        assert got.breakdown[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key


def test_each_stage_prices_at_its_own_tensor_parallel_degree(tables):
    one = _estimator(tables, 2).evaluate(
        autopar.ParallelConfig(pp=2, micro_batch_size=MICRO), BATCH
    )
    two = _estimator(tables, 4).evaluate(
        autopar.ParallelConfig(pp=2, tp=2, micro_batch_size=MICRO), BATCH
    )
    stages = [_meshes(one, 1, 0.0)[0], _meshes(two, 2, 0.0)[1]]
    mixed = _estimator(tables, 3).evaluate_stages(stages, BATCH, MICRO)
    for got, want in zip(mixed.stages, (one.stages[0], two.stages[1]), strict=True):
        assert got.forward_s == pytest.approx(want.forward_s, rel=1e-12)
        assert got.backward_s == pytest.approx(want.backward_s, rel=1e-12)
    assert mixed.stages[0].forward_s != pytest.approx(two.stages[0].forward_s, rel=1e-3)
    assert "1x1 2x1" in mixed.notes[0]


def test_a_layer_cut_between_two_stages_costs_each_its_share(tables):
    estimator = _estimator(tables, 2)
    whole = estimator.evaluate(autopar.ParallelConfig(pp=2, micro_batch_size=MICRO), BATCH)
    first, second = _meshes(whole, 1, 0.0)
    moved = first.parts[-1]  # the first stage's last block, a quarter of it to stage 1
    cut = [
        replace(first, parts=(*first.parts[:-1], replace(moved, share=0.75))),
        replace(second, parts=(replace(moved, share=0.25), *second.parts)),
    ]
    got = estimator.evaluate_stages(cut, BATCH, MICRO)
    cfg = autopar.ParallelConfig(micro_batch_size=MICRO, pp=1)
    block = estimator.layer_times(cfg, estimator.mesh(cfg))[moved.layer].forward_s
    assert got.stages[0].forward_s == pytest.approx(whole.stages[0].forward_s - block / 4)
    assert got.stages[1].forward_s == pytest.approx(whole.stages[1].forward_s + block / 4)
    # and each stage holds its share of the layer's parameters, gradients and optimizer state
    table = next(t for t in tables.layers if t.name == moved.layer)
    state = estimator.memory.model_state(cfg, [table]).total_bytes

    def state_of(stage):
        m = stage.memory
        return m.parameters_bytes + m.gradients_bytes + m.optimizer_bytes

    held = [state_of(s) for s in got.stages]
    before = [state_of(s) for s in whole.stages]
    assert held == pytest.approx([before[0] - state / 4, before[1] + state / 4])


def test_recomputing_part_of_a_layer_pays_that_part_of_its_forward(tables):
    estimator = _estimator(tables, 2)
    whole = estimator.evaluate(autopar.ParallelConfig(pp=2, micro_batch_size=MICRO), BATCH)
    full = estimator.evaluate(
        autopar.ParallelConfig(pp=2, micro_batch_size=MICRO, recompute="full"), BATCH
    )
    got = estimator.evaluate_stages(_meshes(whole, 1, 0.3), BATCH, MICRO)
    for g, none, rec in zip(got.stages, whole.stages, full.stages, strict=True):
        assert g.backward_s == pytest.approx(0.7 * none.backward_s + 0.3 * rec.backward_s)
    # a part keeping less than all its activations lowers the peak
    assert got.peak_memory_bytes < whole.peak_memory_bytes


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("devices", "the 2 stages use 3 devices (tp x dp summed) but the cluster has 2"),
        ("missing", "the stages hold 0.5 of it, not all of it once"),
        ("dp", "dp must divide micro_batch_size=2"),
        ("name", "the model has no layer 'blocks.9'"),
        ("recompute", "recompute=0.8 in [0, share]"),
    ],
)
def test_bad_stages_are_refused_naming_what_is_wrong(tables, change, words):
    estimator = _estimator(tables, 2)
    whole = estimator.evaluate(autopar.ParallelConfig(pp=2, micro_batch_size=MICRO), BATCH)
    first, second = _meshes(whole, 1, 0.0)
    last = first.parts[-1]
    stages = {
        "devices": [first, replace(second, tp=2)],
        "missing": [replace(first, parts=(*first.parts[:-1], replace(last, share=0.5))), second],
        "dp": [replace(first, dp=3, tp=1), second],
        "name": [replace(first, parts=(*first.parts, StagePart("blocks.9"))), second],
        "recompute": [replace(first, parts=(replace(last, share=0.5, recompute=0.8),)), second],
    }[change]
    if change == "dp":
        estimator = _estimator(tables, 4)
    with pytest.raises(autopar.ConfigError, match=re.escape(words)):
        estimator.evaluate_stages(stages, BATCH, MICRO)


def test_acesos_shipped_plans_cover_every_layer_once_on_their_devices():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from aceso_plans import load_plans, operator_saved_bytes, operator_seconds, stage_meshes

    plans = load_plans()
    assert len(plans) == 37
    layers = 24
    names = ["emb", *(f"blocks.{i}" for i in range(layers)), "ln_f", "head"]
    weights = operator_seconds(2048, 2048, 32, 125e12, 600e9)

    def saved(tp):
        return operator_saved_bytes(2048, 2048, 32, tp)

    # Korthikanti et al.'s 34 s h + 5 a s^2 bytes per token of a layer, 10 s h + (24 s h +
    # 5 a s^2) / t of it on each of t tensor-parallel ranks
    assert sum(saved(1)) == 34 * 2048 + 5 * 2048 * 32
    assert sum(saved(4)) == pytest.approx(10 * 2048 + (24 * 2048 + 5 * 2048 * 32) / 4)
    for key, plan in plans.items():
        if plan["num_layers"] != layers:
            continue
        stages = stage_meshes(plan, names, names[1:-2], weights, saved)
        held: dict[str, float] = {}
        for stage in stages:
            for part in stage.parts:
                held[part.layer] = held.get(part.layer, 0.0) + part.share
                assert 0 <= part.recompute <= part.share + 1e-12 and 0 <= part.keeps <= 1
        assert held == pytest.approx(dict.fromkeys(names, 1.0)), key
        assert [s.tp * s.dp for s in stages] == [s["tp"] * s["dp"] for s in plan["stages"]]
    # the 1.3B plan on 2 A10G: one stage of tp 2 recomputing 92 of its 315 operators; its
    # blocks' recompute shares add up to those operators' share of the blocks' time
    one = next(p for k, p in plans.items() if "1_3B_1stages" in k and "a10g" in k)
    (stage,) = stage_meshes(one, names, names[1:-2], weights, saved)
    flags = one["stages"][0]["recompute"]
    assert stage.tp == 2 and flags.count("1") == 92
    rerun = sum(p.recompute for p in stage.parts)
    block_flags = flags[1 : 1 + 13 * layers]
    want = sum(weights[k % 13] for k, f in enumerate(block_flags) if f == "1") / sum(weights)
    assert rerun == pytest.approx(want)


def test_an_aceso_recompute_run_keeps_the_residual_at_each_layer_and_mid_layer():
    """Two layers wholly recomputed in one run keep, each, its input and its post-attention
    residual (the 1st and 2nd layernorm's saved bytes), not the run's first input alone; a
    run of the MLP's GEMM and GELU alone keeps the GEMM's input only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from aceso_plans import RESIDUAL_OPS, operator_saved_bytes, operator_seconds, stage_meshes

    names = ["emb", "blocks.0", "blocks.1", "ln_f", "head"]
    weights = operator_seconds(1024, 1024, 16, 125e12, 600e9)
    nbytes = operator_saved_bytes(1024, 1024, 16)
    ops = "0" + "1" * 26 + "00"  # the embedding, two whole layers recomputed, the tail
    plan = {"num_layers": 2, "stages": [{"ops": len(ops), "tp": 1, "dp": 1, "recompute": ops}]}
    (stage,) = stage_meshes(plan, names, names[1:3], weights, lambda tp: nbytes)
    layers = {p.layer: p for p in stage.parts if p.layer.startswith("blocks")}
    kept = sum(nbytes[k] for k in RESIDUAL_OPS) / sum(nbytes)
    assert RESIDUAL_OPS == (0, 8)
    assert [p.keeps for p in layers.values()] == pytest.approx([kept, kept])
    assert [p.recompute for p in layers.values()] == pytest.approx([1.0, 1.0])
    mlp = "0" + "0" * 9 + "111" + "0" + "0" * 13 + "00"  # layer 0's ops 9-11 recomputed
    plan["stages"][0]["recompute"] = mlp
    (stage,) = stage_meshes(plan, names, names[1:3], weights, lambda tp: nbytes)
    first = next(p for p in stage.parts if p.layer == "blocks.0")
    skipped = nbytes[10] + nbytes[11]  # the GELU's and the down GEMM's inputs re-made
    assert first.keeps == pytest.approx(1 - skipped / sum(nbytes))


def test_the_public_function_prices_a_users_stages_as_the_estimator_does():
    from autopar.models import zoo

    model = zoo.build("gpt-tiny", device="meta", num_layers=4, hidden=512, num_heads=8,
                      seq_len=512)  # fmt: skip
    inputs = zoo.example_inputs("gpt-tiny", model)
    cluster = autopar.Cluster.from_profile("dgx_a100_40g", num_devices=3)
    tables = build_tables(autopar.trace(model, inputs))
    names = [t.name for t in tables.layers]
    cut = names.index("blocks.2")
    stages = [
        StageMesh(tuple(StagePart(n) for n in names[:cut]), tp=1),
        StageMesh(tuple(StagePart(n) for n in names[cut:]), tp=2),
    ]
    got = autopar.evaluate_stages(model, cluster, stages, inputs, global_batch_size=BATCH,
                                  micro_batch_size=MICRO, stack="megatron-lm")  # fmt: skip
    want = Estimator(tables, cluster, options=load_stack("megatron-lm").options)
    assert got.step_time_s == pytest.approx(want.evaluate_stages(stages, BATCH, MICRO).step_time_s)
    with pytest.raises(ValueError, match="needs example_inputs"):
        autopar.evaluate_stages(model, cluster, stages, global_batch_size=BATCH,
                                micro_batch_size=MICRO)  # fmt: skip


def test_a_stages_data_parallel_ranks_split_its_micro_batch_and_sync_its_gradients(tables):
    """Stages of dp 2 fed micro-batches of 2: each rank runs 1, as the uniform pp 2 x dp 2
    config of micro-batch 1 prices it, its gradient all-reduce included."""
    estimator = _estimator(tables, 4)
    want = estimator.evaluate(autopar.ParallelConfig(pp=2, dp=2, micro_batch_size=1), BATCH)
    stages = [replace(s, dp=2) for s in _meshes(want, 1, 0.0)]
    got = estimator.evaluate_stages(stages, BATCH, 2)
    assert got.num_microbatches == want.num_microbatches == BATCH // 2
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert want.breakdown["dp_comm"] > 0
    assert got.breakdown["dp_comm"] == pytest.approx(want.breakdown["dp_comm"])
    assert got.peak_memory_bytes == pytest.approx(want.peak_memory_bytes, rel=1e-12)


def test_a_hop_between_nodes_is_priced_on_the_network(tables):
    """Four stages of tp 4 on two nodes of 8: only the hop from stage 1 to stage 2 crosses the
    nodes, and only its sends take the network's time; the same stages priced one by one
    price the step as the uniform config does."""
    estimator = _estimator(tables, 16)
    cfg = autopar.ParallelConfig(pp=4, tp=4, micro_batch_size=MICRO)
    mesh = estimator.mesh(cfg)
    cluster = estimator.cluster
    assert [mesh.ranks[f"pp_hop{s}"] for s in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert cluster.level_of([4, 8]) == "infiniband" and cluster.level_of([0, 4]) == "nvlink"
    sent = 1e7
    hops = mesh.hop_times("send_recv", sent)
    near = cluster.collective_time("send_recv", sent, [0, 4]).time_s
    assert hops[:3] == pytest.approx(
        (near, cluster.collective_time("send_recv", sent, [4, 8]).time_s, near)
    )
    assert hops[1] > 2 * near
    want = estimator.evaluate(cfg, BATCH)
    got = estimator.evaluate_stages(_meshes(want, 4, 0.0), BATCH, MICRO)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
