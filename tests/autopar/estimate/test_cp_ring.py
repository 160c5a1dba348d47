"""Ring context parallelism priced (ParallelConfig.cp_attention="ring"): cp - 1 steps, each
passing a rank's K and V block to its neighbour beside one block's attention (backward: K, V
and the dK, dV partial sums), only the excess over the attention exposed;
the all-gather's collectives are all exposed. The search offers both; exports name them."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.estimate.layer_cost import _cp_comm
from autopar.estimate.tables import AttentionOp, LayerTable
from autopar.models import zoo
from autopar.solve.space import SpaceLimits, inner_choices


def _comm(kind: str, nbytes: float, axis: str) -> float:
    """1 ns a byte for every collective: the arithmetic, not a network."""
    assert axis == "cp"
    return {"send_recv": 1.0, "all_gather": 3.0, "reduce_scatter": 3.0}[kind] * nbytes * 1e-9


@pytest.fixture(scope="module")
def attention_layer():
    model = zoo.build("llama-tiny", device="meta", num_layers=1)
    tables = autopar.estimate.build_tables(
        autopar.trace(model, zoo.example_inputs("llama-tiny", model))
    )
    return next(t for t in tables.layers if t.attention)


@pytest.mark.parametrize(("attn_fwd", "attn_bwd"), [(0.0, 0.0), (1.0, 1.0)])
def test_ring_exposes_only_what_a_blocks_attention_does_not_hide(
    attention_layer, attn_fwd, attn_bwd
):
    table: LayerTable = attention_layer
    (op,) = table.attention
    assert isinstance(op, AttentionOp)
    cfg = ParallelConfig(cp=4, cp_attention="ring", micro_batch_size=2)
    k = op.kv_sent_bytes * 2 / 2  # K (or V) of a micro-batch of 2, tp = 1, act_scale 1
    block = k / 4
    fwd, bwd = _cp_comm(table, cfg, 1.0, _comm, attn_fwd, attn_bwd)
    want_f = 3 * max(0.0, 2 * block * 1e-9 - attn_fwd / 4)
    want_b = 3 * max(0.0, 4 * block * 1e-9 - attn_bwd / 4)
    assert (fwd, bwd) == pytest.approx((want_f, want_b))
    gathered = _cp_comm(table, replace(cfg, cp_attention="all_gather"), 1.0, _comm, 1.0, 1.0)
    assert gathered == pytest.approx((2 * 3 * k * 1e-9, 2 * 3 * k * 1e-9))  # nothing hidden


def test_ring_is_checked_searched_and_exported():
    with pytest.raises(autopar.ConfigError, match="cp_attention=ring needs cp > 1"):
        ParallelConfig(cp_attention="ring").validate()
    with pytest.raises(autopar.ConfigError, match="cp_attention must be one of all_gather, ring"):
        ParallelConfig(cp=2, cp_attention="ulysses").validate()
    lim = SpaceLimits(
        world_size=2, devices_per_node=2, num_blocks=2, num_heads=4, seq_len=64,
        num_experts=0, global_batch_size=2, micro_batch_sizes=(1,),
    )  # fmt: skip
    configs = list(inner_choices(lim, (1, 1, 2, 1, 1, 1)))  # cp=2
    assert {c.cp_attention for c in configs} == {"all_gather", "ring"}
    assert len(configs) == 2 * len({replace(c, cp_attention="all_gather") for c in configs})


def test_ring_is_refused_and_not_offered_where_attention_drops_probabilities():
    model = zoo.build("gpt-tiny", device="meta", dropout=0.1, num_layers=2)
    inputs = zoo.example_inputs("gpt-tiny", model)
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    ring = ParallelConfig(cp=2, cp_attention="ring")
    with pytest.raises(autopar.ConfigError, match="cp_attention=ring: GPT drops attention"):
        autopar.evaluate(model, cluster, ring, inputs, global_batch_size=2)
    gathered = replace(ring, cp_attention="all_gather")
    assert autopar.evaluate(model, cluster, gathered, inputs, global_batch_size=2).fits
    from autopar.runtime.capability import runtime_limits
    from autopar.solve.limits import space_limits

    graph = autopar.trace(model, inputs)
    lim = replace(space_limits(model, graph, cluster, 2), max_cp=2)
    bounded, notes = runtime_limits(model, lim, "autopar", ({}, ""), "bf16")
    assert not bounded.cp_ring and any("no ring context parallelism" in n for n in notes)


def test_the_ring_sends_keys_and_values_before_their_gqa_repeat(attention_layer):
    # llama-tiny has 4 query heads and 2 key/value heads; its attention op reads K and V
    # repeated to 4 (`repeat_kv`), while the ring and the all-gather move the 2 heads' (the
    # runtime's `CPAttention`, Megatron's and TransformerEngine's): half the bytes here
    cfg = zoo.config("llama-tiny")
    (op,) = attention_layer.attention
    assert op.kv_sent_bytes == op.kv_bytes * cfg.num_kv_heads / cfg.num_heads
    mha = zoo.build("gpt-tiny", device="meta", num_layers=1)
    tables = autopar.estimate.build_tables(autopar.trace(mha, zoo.example_inputs("gpt-tiny", mha)))
    (whole,) = next(t for t in tables.layers if t.attention).attention
    assert whole.kv_sent_bytes == whole.kv_bytes  # no repeat: what attention reads
