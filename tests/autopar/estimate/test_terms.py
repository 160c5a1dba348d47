"""Every breakdown term of an estimate, checked by hand on a round-number machine.

The machine (round.toml): 100 TFLOP/s bf16, 1 TB/s memory, full efficiency at every size, no
launch overhead or latency; 4 devices per node on 100 GB/s links, 10 GB/s across nodes. The
model is traced in fp32 and trained in bf16, so activation bytes are halved (act_scale 0.5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.models import zoo

ROUND = Path(__file__).with_name("round.toml")
PEAK, HBM, FAST, SLOW = 100e12, 1e12, 100e9, 10e9


def cluster(n: int) -> Cluster:
    return Cluster.from_profile(ROUND, num_devices=n)


class Stack(nn.Module):
    """Equal square linear layers: every pipeline stage gets the same work."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def stack_tables():
    model = Stack(1024, 4)
    return model, build_tables(autopar.trace(model, torch.randn(1, 1024, 1024)))


@pytest.fixture(scope="module")
def gpt():
    model = zoo.build("gpt-tiny")
    cfg = zoo.config("gpt-tiny")
    graph = autopar.trace(model, zoo.example_inputs("gpt-tiny", model))
    return cfg, graph, build_tables(graph)


def test_compute_is_flops_over_peak(stack_tables):
    _, tables = stack_tables
    est = Estimator(tables, cluster(1)).evaluate(ParallelConfig(micro_batch_size=2), 8)
    flops = 2 * 1024 * 1024 * 1024  # one layer, one sample
    assert est.num_microbatches == 4
    assert est.breakdown["compute_forward"] == pytest.approx(4 * 2 * 4 * flops / PEAK)
    # weight grad everywhere, input grad for all but the first layer (its input is data)
    assert est.breakdown["compute_backward"] == pytest.approx(4 * 2 * 7 * flops / PEAK)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    assert est.mfu == pytest.approx(est.model_flops / (est.step_time_s * PEAK))


def test_optimizer_and_model_state_memory(stack_tables):
    _, tables = stack_tables
    est = Estimator(tables, cluster(1)).evaluate(ParallelConfig(), 1)
    params = 4 * 1024 * 1024
    # AdamW, mixed precision: 30 bytes per parameter at 1 TB/s (+10 launches, free here)
    assert est.breakdown["optimizer"] == pytest.approx(params * 30 / HBM)
    # clipping reads the fp32 gradients for the norm and scales them: 12 bytes per parameter
    assert est.breakdown["grad_clip"] == pytest.approx(params * 12 / HBM)
    memory = est.stages[0].memory
    assert memory.parameters_bytes == 2 * params
    assert memory.gradients_bytes == 2 * params
    assert memory.optimizer_bytes == 12 * params


def test_data_parallel_all_reduce_with_and_without_overlap(stack_tables):
    _, tables = stack_tables
    grad = 4 * 1024 * 1024 * 4  # fp32 gradients
    ring = 2 * (2 - 1) / 2 * grad / FAST
    plain = Estimator(tables, cluster(2), options=CostOptions(overlap_grad_reduce=False))
    est = plain.evaluate(ParallelConfig(dp=2), 2)
    assert est.breakdown["dp_comm"] == pytest.approx(ring)
    overlapped = Estimator(tables, cluster(2)).evaluate(ParallelConfig(dp=2), 2)
    backward = overlapped.breakdown["compute_backward"]
    bucket = ring * min(1.0, 25 * 2**20 / grad)
    assert overlapped.breakdown["dp_comm"] == pytest.approx(max(bucket, ring - backward))
    # autopar's runtime all-reduces a replicated model's gradients after the backward: all of
    # it exposed
    after = Estimator(tables, cluster(2), options=CostOptions(replicated_grad_overlap=False))
    assert after.evaluate(ParallelConfig(dp=2), 2).breakdown["dp_comm"] == pytest.approx(ring)


class Embedded(nn.Module):
    """A token embedding larger than a gradient bucket, then equal linear layers."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_last_bucket_holds_the_whole_embedding():
    # buckets take whole tensors, and the embedding's gradient is the last ready: its whole
    # reduction is exposed, not a bucket's share of the total, and under ZeRO-1 with the
    # parameter gather overlapped the next forward waits for its whole gather
    model = Embedded(16384, 1024, 4)
    tables = build_tables(autopar.trace(model, torch.zeros(1, 1024, dtype=torch.long)))
    emb, params = 16384 * 1024, 16384 * 1024 + 4 * 1024 * 1024
    assert emb * 4 > 25 * 2**20  # larger than DDP's bucket
    ring = 2 * (2 - 1) / 2 * params * 4 / FAST
    est = Estimator(tables, cluster(2)).evaluate(ParallelConfig(dp=2), 2)
    backward = est.breakdown["compute_backward"]
    last = ring * emb / params
    assert est.breakdown["dp_comm"] == pytest.approx(max(last, ring - backward))
    opts = CostOptions(overlap_param_gather=True)
    zero1 = Estimator(tables, cluster(2), options=opts).evaluate(
        ParallelConfig(fsdp=2, zero_stage=1), 2
    )
    reduce_scatter = 1 / 2 * params * 4 / FAST
    all_gather = 1 / 2 * params * 2 / FAST
    forward = zero1.breakdown["compute_forward"]
    exposed = max(reduce_scatter * emb / params, reduce_scatter - backward)
    exposed += all_gather * emb / params + max(0.0, all_gather * (1 - emb / params) - forward)
    assert zero1.breakdown["dp_comm"] == pytest.approx(exposed)


def test_zero1_reduce_scatters_grads_and_gathers_params(stack_tables):
    _, tables = stack_tables
    params = 4 * 1024 * 1024
    opts = CostOptions(overlap_grad_reduce=False)
    est = Estimator(tables, cluster(4), options=opts).evaluate(
        ParallelConfig(fsdp=4, zero_stage=1), 4
    )
    reduce_scatter = 3 / 4 * params * 4 / FAST
    all_gather = 3 / 4 * params * 2 / FAST
    assert est.breakdown["dp_comm"] == pytest.approx(reduce_scatter + all_gather)
    assert est.stages[0].memory.optimizer_bytes == pytest.approx(12 * params / 4)


def test_fsdp_gathers_every_layer_forward_and_backward(stack_tables):
    _, tables = stack_tables
    layer = 1024 * 1024
    opts = CostOptions(fsdp_prefetch=False)
    est = Estimator(tables, cluster(4), options=opts).evaluate(
        ParallelConfig(fsdp=4, zero_stage=3), 8
    )
    gather = 3 / 4 * layer * 2 / FAST
    scatter = 3 / 4 * layer * 4 / FAST
    per_microbatch = 4 * (2 * gather + scatter)
    assert est.num_microbatches == 2
    assert est.breakdown["fsdp_comm"] == pytest.approx(2 * per_microbatch)
    prefetched = Estimator(tables, cluster(4)).evaluate(ParallelConfig(fsdp=4, zero_stage=3), 8)
    assert prefetched.breakdown["fsdp_comm"] < est.breakdown["fsdp_comm"]
    assert prefetched.stages[0].memory.parameters_bytes == pytest.approx(2 * 4 * layer / 4)


def test_fsdp_list_collectives_add_a_copy_per_rank(stack_tables, tmp_path):
    _, tables = stack_tables
    # round.toml with a 1 us launch: each of the 4 copies of a call costs 1 us to issue
    path = tmp_path / "round_launch.toml"
    path.write_text(
        ROUND.read_text().replace("launch_overhead_s = 0.0", "launch_overhead_s = 1e-6")
    )
    four = Cluster.from_profile(path, num_devices=4)
    layer = 1024 * 1024
    base = CostOptions(fsdp_prefetch=False)
    copies = CostOptions(fsdp_prefetch=False, fsdp_list_copies=True)
    cfg = ParallelConfig(fsdp=4, zero_stage=3)
    plain = Estimator(tables, four, options=base).evaluate(cfg, 4)
    listed = Estimator(tables, four, options=copies).evaluate(cfg, 4)
    gather = 3 / 4 * layer * 2 / FAST  # 15.7 us: the host's 4 us of issuing hides behind it
    scatter = 3 / 4 * layer * 4 / FAST
    m_gather = 2 * (layer * 2 / 4) / HBM  # each copy moves its quarter in and out
    m_scatter = 2 * (layer * 4 / 4) / HBM
    listed_gather = gather + 4 * m_gather
    listed_scatter = 4 * max(1e-6, m_scatter) + m_scatter + scatter
    # per layer: forward gather, backward gather, reduce-scatter; 4 layers, 1 micro-batch
    assert plain.breakdown["fsdp_comm"] == pytest.approx(4 * (2 * gather + scatter))
    assert listed.breakdown["fsdp_comm"] == pytest.approx(4 * (2 * listed_gather + listed_scatter))


def test_pipeline_bubble_is_p_minus_1_over_m(stack_tables, tmp_path):
    _, tables = stack_tables
    # p2p between stages over a practically infinite link: the bubble alone remains
    text = ROUND.read_text().replace(
        "bandwidth_bytes_per_s = 100e9", "bandwidth_bytes_per_s = 1e30"
    )
    path = tmp_path / "round_fast.toml"
    path.write_text(text)
    two = Cluster.from_profile(path, num_devices=2)
    for schedule in ("gpipe", "1f1b"):
        est = Estimator(tables, two).evaluate(ParallelConfig(pp=2, schedule=schedule), 8)
        first, last = est.stages
        # Stage 1 is the busier (layer 0 computes no input gradient). Its first forward waits
        # for stage 0's, and stage 0's last backward follows stage 1's: the bubble is one
        # micro-batch of stage 0's work, which is (p-1)/m of the busy time for equal stages.
        assert first.forward_s == pytest.approx(last.forward_s)
        assert first.backward_s < last.backward_s
        busy = est.breakdown["compute_forward"] + est.breakdown["compute_backward"]
        assert busy == pytest.approx(8 * (last.forward_s + last.backward_s))
        bubble = est.breakdown["pipeline_bubble"]
        assert bubble == pytest.approx(first.forward_s + first.backward_s, rel=1e-6)
    # 1F1B holds p - i micro-batches of activations on stage i, GPipe all m
    one_f = Estimator(tables, two).evaluate(ParallelConfig(pp=2, schedule="1f1b"), 8)
    gpipe = Estimator(tables, two).evaluate(ParallelConfig(pp=2, schedule="gpipe"), 8)
    act = [s.memory.activation_bytes for s in one_f.stages]
    assert act[0] == pytest.approx(2 * act[1])
    assert gpipe.stages[1].memory.activation_bytes == pytest.approx(8 * act[1])


def test_tensor_parallel_all_reduces_two_per_block(gpt):
    cfg, graph, tables = gpt
    blocks = [t for t in tables.layers if t.kind == "block"]
    sample = cfg.seq_len * cfg.hidden * 4  # fp32 [1, s, h]
    assert all(t.tp_allreduce_bytes == (sample, sample) for t in blocks)
    embedding = next(t for t in tables.layers if t.name == "tok_emb")
    assert embedding.tp_allreduce_bytes == (sample,)  # vocab-parallel token embedding
    positions = next(t for t in tables.layers if t.name == "pos_emb")
    assert positions.tp_allreduce_bytes == ()  # position embeddings stay replicated
    est = Estimator(tables, cluster(2)).evaluate(ParallelConfig(tp=2), 4)
    one = 2 * (2 - 1) / 2 * sample * 0.5 / FAST  # bf16: half the traced bytes
    calls = 2 * (2 * len(blocks) + 1)  # forward and backward
    assert est.breakdown["tp_comm"] == pytest.approx(4 * calls * one)
    sp = Estimator(tables, cluster(2)).evaluate(ParallelConfig(tp=2, sequence_parallel=True), 4)
    assert sp.breakdown["tp_comm"] == pytest.approx(est.breakdown["tp_comm"])
    overlap = Estimator(tables, cluster(2), options=CostOptions(tp_comm_overlap=0.5))
    assert overlap.evaluate(ParallelConfig(tp=2), 4).breakdown["tp_comm"] == pytest.approx(
        est.breakdown["tp_comm"] / 2
    )


def test_tensor_parallel_shards_compute_and_activations(gpt):
    _, _, tables = gpt
    one = Estimator(tables, cluster(1)).evaluate(ParallelConfig(), 4)
    two = Estimator(tables, cluster(2)).evaluate(ParallelConfig(tp=2), 4)
    matmul_share = sum(
        op.flops for t in tables.layers for op in t.matmuls if op.shard == "tp"
    ) + sum(op.flops for t in tables.layers for op in t.attention)
    assert matmul_share > 0
    assert two.breakdown["compute_forward"] < one.breakdown["compute_forward"]
    sp = Estimator(tables, cluster(2)).evaluate(ParallelConfig(tp=2, sequence_parallel=True), 4)
    a_tp = two.stages[0].memory.activation_bytes
    a_sp = sp.stages[0].memory.activation_bytes
    a_one = one.stages[0].memory.activation_bytes
    assert a_sp < a_tp < a_one


def test_context_parallel_all_gathers_keys_and_values(gpt):
    cfg, _, tables = gpt
    est = Estimator(tables, cluster(2)).evaluate(ParallelConfig(cp=2), 2)
    blocks = [t for t in tables.layers if t.kind == "block"]
    gathered = cfg.seq_len * cfg.hidden * 4 * 0.5  # K (or V), bf16, the whole sequence
    move = 1 / 2 * gathered / FAST  # ring all-gather / reduce-scatter over 2 ranks
    per_layer = 2 * move + 2 * move  # K and V gathered forward, dK and dV scattered backward
    assert est.breakdown["cp_comm"] == pytest.approx(2 * len(blocks) * per_layer)


def test_expert_parallel_all_to_alls(gpt):
    model = zoo.build("moe-tiny")
    cfg = zoo.config("moe-tiny")
    tables = build_tables(autopar.trace(model, zoo.example_inputs("moe-tiny", model)))
    moe = [t for t in tables.layers if t.moe_num_experts]
    assert moe and all(t.moe_top_k == cfg.top_k for t in moe)
    est = Estimator(tables, cluster(2)).evaluate(ParallelConfig(dp=2, ep=2), 2)
    payload = cfg.seq_len * cfg.hidden * 4 * cfg.top_k * 0.5
    a2a = (2 - 1) / 2 * payload / FAST  # half of each rank's tokens leave it
    assert est.breakdown["ep_comm"] == pytest.approx(4 * len(moe) * a2a)
    assert (
        est.stages[0].memory.parameters_bytes
        < Estimator(tables, cluster(2))
        .evaluate(ParallelConfig(dp=2), 2)
        .stages[0]
        .memory.parameters_bytes
    )


def test_recompute_adds_forward_and_saves_memory(gpt):
    _, _, tables = gpt
    est = {
        r: Estimator(tables, cluster(1)).evaluate(ParallelConfig(recompute=r), 2)
        for r in ("none", "selective", "full")
    }
    assert est["none"].breakdown["recompute"] == 0
    # full re-runs the blocks' forward; embedding and head are never recomputed (runtime)
    e = Estimator(tables, cluster(1))
    fwd = e.layer_times(ParallelConfig(), e.mesh(ParallelConfig()))
    blocks = sum(fwd[t.name].compute_forward_s for t in tables.layers if t.kind == "block")
    every = sum(fwd[t.name].compute_forward_s for t in tables.layers)
    assert 0 < blocks < every
    assert est["full"].breakdown["recompute"] == pytest.approx(
        est["full"].breakdown["compute_forward"] * blocks / every
    )
    assert 0 < est["selective"].breakdown["recompute"] < est["full"].breakdown["recompute"]
    act = {r: e.stages[0].memory.activation_bytes for r, e in est.items()}
    assert act["full"] < act["selective"] < act["none"]


def test_bad_batches_and_depths_are_refused(stack_tables):
    _, tables = stack_tables
    est = Estimator(tables, cluster(2))
    with pytest.raises(
        ConfigError, match=r"global_batch_size=3 is not a multiple of micro_batch_size=1 x dp=2"
    ):
        est.evaluate(ParallelConfig(dp=2), 3)
    big = Estimator(tables, Cluster.from_profile(ROUND, num_devices=8))
    with pytest.raises(ConfigError, match="8 model chunks but the model has 4 repeated layers"):
        big.evaluate(ParallelConfig(pp=8), 8)
    with pytest.raises(ConfigError, match="world size 2"):
        est.evaluate(ParallelConfig(dp=4), 4)
