"""Expert layers priced as the runtime runs them.

With ep > 1 the all-to-all dispatch runs each token on its top-k experts: a dense-dispatch
MoE's (`autopar.models.moe`) expert FLOPs and activations are the traced ones times
top_k / num_experts, plus the dispatch's two copies of the routed rows; with ep = 1 the dense
block runs every expert on every token, as traced. The experts' gradients stay out of the dp
all-reduce and are summed over the dp / ep ranks holding the same experts. On round.toml:
ring collectives at FAST bytes/s inside a node, no latency, full efficiency.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.as_run import routed_layer
from autopar.estimate.saved_split import module_kinds
from autopar.models import zoo

ROUND = Path(__file__).with_name("round.toml")
FAST = 100e9


@pytest.fixture(scope="module")
def moe():
    model = zoo.build("moe-tiny")
    tables = build_tables(autopar.trace(model, zoo.example_inputs("moe-tiny", model)))
    return zoo.config("moe-tiny"), tables


def _estimator(tables, n: int) -> Estimator:
    options = CostOptions(overlap_grad_reduce=False)
    return Estimator(tables, Cluster.from_profile(ROUND, num_devices=n), options=options)


def test_routed_layer_scales_the_expert_work_by_top_k_over_experts(moe):
    cfg, tables = moe
    f = cfg.top_k / cfg.num_experts
    layers = [t for t in tables.layers if t.moe_num_experts]
    assert layers and all(t.moe_routed_fraction == f for t in layers)
    for dense in layers:
        routed = routed_layer(dense)
        for a, b in zip(dense.matmuls, routed.matmuls, strict=True):
            scale = f if a.shard == "expert" else 1.0
            assert b.flops == pytest.approx(a.flops * scale)
            assert b.backward_flops == pytest.approx(a.backward_flops * scale)
            assert b.weight_bytes == a.weight_bytes
        assert any(op.shard == "expert" for op in dense.matmuls)
        for policy, split in dense.activations.items():
            # kept without recompute and by module policies that do not re-run the MoE layer
            kinds = module_kinds(policy)
            keeps = policy == "none" or (kinds is not None and "moe" not in kinds)
            extra = 2 * dense.moe_dispatch_bytes if keeps else 0.0
            # the experts' intermediate-width values, and their hidden-wide rows ("routed",
            # which expert tensor parallelism does not split) with the dispatch's copies
            assert routed.activations[policy]["expert"] == pytest.approx(split["expert"] * f)
            assert routed.activations[policy]["routed"] == pytest.approx(
                split["routed"] * f + extra
            )
            assert policy != "none" or split["routed"] > 0  # each expert output is hidden-wide
            assert routed.activations[policy]["rep"] == split["rep"]
        # tokens x top_k x hidden x fp32: what one all-to-all moves, per sample
        assert dense.moe_dispatch_bytes == cfg.seq_len * cfg.top_k * cfg.hidden * 4
        assert routed_layer(routed) is routed
    dense_layers = [t for t in tables.layers if not t.moe_num_experts]
    assert all(routed_layer(t) is t for t in dense_layers)


def test_expert_parallel_prices_routed_compute_and_activations(moe):
    cfg, tables = moe
    e = _estimator(tables, 2)
    dense_cfg, ep_cfg = ParallelConfig(dp=2), ParallelConfig(dp=2, ep=2)
    dense = e.layer_times(dense_cfg, e.mesh(dense_cfg))
    routed = e.layer_times(ep_cfg, e.mesh(ep_cfg))
    f = cfg.top_k / cfg.num_experts
    for t in tables.layers:
        expert_flops = sum(op.flops for op in t.matmuls if op.shard == "expert")
        if not expert_flops:
            assert routed[t.name].compute_forward_s == dense[t.name].compute_forward_s
            continue
        # the time falls, by at most the expert FLOPs routing skips at peak (round.toml)
        cut = dense[t.name].compute_forward_s - routed[t.name].compute_forward_s
        assert cut > 0
        assert routed[t.name].compute_forward_s >= expert_flops * f / 100e12
        per_rank = e.memory.activation_bytes(ep_cfg, t, "none") / e.act_scale
        splits = routed_layer(t).activations
        want = sum(splits["none"].values())
        # the eager norms' fp32 upcasts at fp32's width (`kernel_savings.norm_upcasts`)
        want += sum(splits["+fp32"].values()) * (1 / e.act_scale - 1)
        assert per_rank == pytest.approx(want)
        assert per_rank < sum(t.activations["none"].values())
    # the MFU numerator counts routed FLOPs whatever the config
    a, b = e.evaluate(dense_cfg, 2), e.evaluate(ep_cfg, 2)
    assert a.model_flops == b.model_flops


@pytest.mark.parametrize(("dp", "ep"), [(4, 2), (2, 2)])
def test_expert_gradients_leave_the_dp_all_reduce_for_their_replicas(moe, dp, ep):
    _, tables = moe
    e = _estimator(tables, dp)
    cfg = ParallelConfig(dp=dp, ep=ep)
    est = e.evaluate(cfg, dp)
    layers = list(tables.layers)
    experts = sum(t.params_expert for t in layers) / ep * 4  # fp32 gradients of this rank's
    dense = sum(t.params_tp + t.params_rep for t in layers) * 4
    ring = 2 * (dp - 1) / dp * dense / FAST
    replicas = dp // ep  # ranks holding the same experts
    expert_sync = 2 * (replicas - 1) / replicas * experts / FAST
    assert est.breakdown["dp_comm"] == pytest.approx(ring + expert_sync)
    # the old price: every gradient, experts included, all-reduced over dp
    everything = 2 * (dp - 1) / dp * (dense + experts) / FAST
    assert est.breakdown["dp_comm"] < everything


def test_a_stacked_expert_layer_prices_each_experts_gemm_at_its_own_size():
    """transformers' stacks trace one grouped matmul over every expert; the runtime runs one
    GEMM per expert on its routed rows, each at the matmul efficiency of its own size."""
    from autopar.estimate.layer_cost import _gemms_time
    from autopar.models import hf

    model = hf.build("mixtral-tiny-hf", device="meta")
    tables = build_tables(autopar.trace(model, hf.example_inputs("mixtral-tiny-hf", model)))
    moe_layer = next(t for t in tables.layers if t.moe_num_experts)
    groups = {op.groups for op in moe_layer.matmuls if op.shard == "expert"}
    assert groups == {model.config.num_local_experts}
    assert all(op.groups == 1 for op in moe_layer.matmuls if op.shard != "expert")
    dense = build_tables(
        autopar.trace(zoo.build("moe-tiny"), zoo.example_inputs("moe-tiny", zoo.build("moe-tiny")))
    )
    assert all(op.groups == 1 for t in dense.layers for op in t.matmuls)  # one op per expert
    device = Cluster.from_profile("dgx_h100", 1).profile.device
    flops, io = 8 * 2 * 512 * 4096 * 14336, 1e6  # 8 experts of 512 rows
    grouped, whole = (
        _gemms_time(device, flops, io, "bf16", 8),
        _gemms_time(device, flops, io, "bf16", 1),
    )
    one = _gemms_time(device, flops / 8, io / 8, "bf16", 1)
    assert whole < grouped  # small GEMMs run further from the peak
    assert grouped == pytest.approx(8 * one - 7 * device.launch_overhead_s)  # one launch
