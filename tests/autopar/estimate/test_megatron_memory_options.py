"""Memory Megatron-Core saves where the eager trace keeps more, priced where a stack states it:
Adam's moments in BF16 (`CostOptions.moment_bytes`, the precision-aware optimizer), the
recompute of multi-latent attention's up-projections (`CostOptions.recompute_up_projections`,
recompute_modules "mla_up_proj") and fused RMSNorm and SwiGLU kernels
(`CostOptions.fused_kernel_activations`), both found on the trace by
`autopar.estimate.kernel_savings`."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.kernel_savings import fused_kernel_surplus, norm_upcasts, up_projection_region
from autopar.models import hf
from cost_models.memory import model_state_bytes


@pytest.fixture(scope="module")
def deepseek():
    model = hf.build("deepseek-v3-tiny-hf")
    graph = autopar.trace(model, hf.example_inputs("deepseek-v3-tiny-hf", model))
    return model.config, graph


def _estimator(graph, **options) -> Estimator:
    cluster = Cluster.from_profile("dgx_h100", num_devices=8)
    return Estimator(build_tables(graph), cluster, precision="bf16", options=CostOptions(**options))


def test_bf16_moments_keep_8_bytes_of_adam_state_per_parameter_not_12():
    # fp32 master weights (4) + two BF16 moments (2 + 2), over the ZeRO shards
    state = model_state_bytes(
        7.5e9, precision="bf16", optimizer="adam", zero_stage=1, shard_degree=64, moment_bytes=2
    )
    assert state.optimizer_bytes == 8 * 7.5e9 / 64
    with pytest.raises(ValueError, match="moment_bytes must be 1, 2 or 4, got 3"):
        model_state_bytes(1e9, precision="bf16", optimizer="adam", zero_stage=1, shard_degree=1,
                          moment_bytes=3)  # fmt: skip
    with pytest.raises(ValueError, match="moment_bytes must be 1, 2 or 4"):
        CostOptions(moment_bytes=8)


def test_bf16_moments_shrink_the_plans_optimizer_state_and_step(deepseek):
    _, graph = deepseek
    cfg = ParallelConfig(dp=1, fsdp=8, zero_stage=1)
    fp32, bf16 = (_estimator(graph, moment_bytes=b).evaluate(cfg, 64) for b in (4, 2))
    opt = [e.stages[0].memory.optimizer_bytes for e in (fp32, bf16)]
    assert opt[1] == pytest.approx(opt[0] * 8 / 12, rel=1e-9)
    # the step reads and writes the moments: AdamW's 30 bytes per parameter become 22
    assert fp32.breakdown["optimizer"] > bf16.breakdown["optimizer"]


def test_the_region_is_the_attentions_q_k_and_v_made_from_the_latents(deepseek):
    config, graph = deepseek
    nodes = graph.nodes
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    for layer in blocks:
        region, ups = up_projection_region(layer, nodes)
        assert {nodes[u].module_path.rsplit(".", 1)[1] for u in ups} == {"q_b_proj", "kv_b_proj"}
        # of what the layer saves, the region holds the attention's q, k and v: heads x seq x
        # (nope + rope) for q and k, heads x seq x v_head_dim for v, fp32 as traced
        seq, heads = graph.input_shapes[0][-1], config.num_attention_heads
        qk = heads * seq * (config.qk_nope_head_dim + config.qk_rope_head_dim)
        dropped = [v for v in layer.saved_values["none"] if v in region]
        dropped_bytes = sum(4 * math.prod(nodes[v].shapes[0]) for v in dropped)
        assert dropped_bytes == 4 * (2 * qk + heads * seq * config.v_head_dim)


def test_llama_has_no_up_projections_and_prices_the_same():
    model = hf.build("llama-tiny-hf")
    graph = autopar.trace(model, hf.example_inputs("llama-tiny-hf", model))
    assert all(not any(up_projection_region(x, graph.nodes)) for x in graph.layers)
    cfg = ParallelConfig(dp=8)
    plain, option = (
        _estimator(graph, recompute_up_projections=b).evaluate(cfg, 64) for b in (False, True)
    )
    assert option.step_time_s == plain.step_time_s
    assert option.peak_memory_bytes == plain.peak_memory_bytes


def test_recomputing_the_up_projections_trades_their_gemms_for_q_k_and_v(deepseek):
    _, graph = deepseek
    cfg = ParallelConfig(dp=8)
    plain, option = (_estimator(graph, recompute_up_projections=b) for b in (False, True))
    tables = plain.tables.layers
    block = next(t for t in tables if any(op.up_projection for op in t.matmuls))
    kept = [plain.memory.activation_bytes(cfg, block, p) for p in ("none", "up_proj")]
    qkv = sum(block.activations["-up_proj"].values())
    assert qkv > 0 and kept[0] - kept[1] == pytest.approx(qkv * plain.act_scale, rel=1e-9)
    a, b = plain.evaluate(cfg, 64), option.evaluate(cfg, 64)
    assert b.stages[0].memory.activation_bytes < a.stages[0].memory.activation_bytes
    # the backward re-runs the up-projection GEMMs: recompute time where there was none
    assert a.breakdown["recompute"] == 0.0 < b.breakdown["recompute"]
    # under a recompute policy of its own, the option changes nothing
    full = replace(cfg, recompute="full")
    assert plain.evaluate(full, 64).step_time_s == option.evaluate(full, 64).step_time_s


def test_fused_kernels_keep_neither_the_normalised_value_nor_silu_of_the_gate():
    model = hf.build("llama-tiny-hf")
    graph = autopar.trace(model, hf.example_inputs("llama-tiny-hf", model))
    config, nodes = model.config, graph.nodes
    seq = graph.input_shapes[0][-1]
    plain, fused = (_estimator(graph, fused_kernel_activations=b) for b in (False, True))
    cfg = ParallelConfig(dp=8)
    for layer in (x for x in graph.layers if x.kind == "block"):
        surplus = fused_kernel_surplus(layer, nodes)
        ops = sorted(nodes[v].op for v in surplus & set(layer.saved_values["none"]))
        assert ops == ["aten.silu.default", "aten.to.dtype", "aten.to.dtype"]
        # two RMSNorms' normalised values (seq x hidden) and silu(gate) (seq x ffn), fp32
        expected = 4 * seq * (2 * config.hidden_size + config.intermediate_size)
        table = next(t for t in plain.tables.layers if t.name == layer.name)
        assert sum(table.activations["-fused"].values()) == expected
        # and the eager norms' inputs, upcast to fp32 and saved so (`norm_upcasts`), where
        # the fused kernel saves its bf16 input
        upcasts = norm_upcasts(layer, nodes)
        assert sorted(nodes[v].module_path.rsplit(".", 1)[-1] for v in upcasts) == [
            "input_layernorm",
            "post_attention_layernorm",
        ]
        wider = 4 * seq * 2 * config.hidden_size * (1 - plain.act_scale)
        kept = [e.memory.activation_bytes(cfg, table, "none") for e in (plain, fused)]
        assert kept[0] - kept[1] == pytest.approx(expected * plain.act_scale + wider, rel=1e-9)
    # GPT-2's LayerNorm is one op and its GELU ungated: nothing to drop
    gpt2 = hf.build("gpt2-tiny-hf")
    g2 = autopar.trace(gpt2, hf.example_inputs("gpt2-tiny-hf", gpt2))
    assert not any(fused_kernel_surplus(x, g2.nodes) for x in g2.layers)
