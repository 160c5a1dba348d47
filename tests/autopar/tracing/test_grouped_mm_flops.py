"""Grouped-GEMM experts are counted (autopar.tracing.ops registers FLOP formulas for
aten._grouped_mm and transformers' grouped_mm_fallback and its backward, which torch's FLOP
counter lacks): a Hugging Face MoE traced with its default "grouped_mm" experts has exactly the
forward and backward FLOPs of the same model with "batched_mm" experts (which run aten.bmm),
and those are the routed FLOPs: tokens x top_k through each expert's three projections."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import hf
from autopar.tracing.ops import _grouped_mm_flops

SEQ = 256


def _trace(name: str, impl: str):
    model = hf.build(name, device="meta", experts_implementation=impl)
    return model, autopar.trace(model, (torch.randint(0, 100, (1, SEQ), device="meta"),))


@pytest.mark.parametrize("name", ["mixtral-tiny-hf", "qwen2-moe-tiny-hf", "deepseek-v3-tiny-hf"])
def test_grouped_mm_experts_count_what_batched_mm_experts_count(name):
    _, bmm = _trace(name, "batched_mm")
    model, grouped = _trace(name, "grouped_mm")
    ops = {n.op for n in grouped.nodes.values() if "experts" in n.module_path}
    assert any("grouped_mm" in op for op in ops)  # the experts did run the grouped GEMM
    assert grouped.forward_flops == bmm.forward_flops
    assert grouped.backward_flops == bmm.backward_flops
    c = model.config
    experts = sum(
        n.flops for n in grouped.nodes.values() if "grouped_mm" in n.op and n.kind == "call"
    )
    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    moe_layers = c.num_hidden_layers - getattr(c, "first_k_dense_replace", 0)  # DeepSeek-V3
    routed = 2 * SEQ * c.num_experts_per_tok * 3 * c.hidden_size * ffn * moe_layers
    assert experts == routed


def test_the_formula_covers_each_operand_layout():
    assert _grouped_mm_flops((12, 16), (4, 16, 32)) == 2 * 12 * 16 * 32  # tokens x experts
    assert _grouped_mm_flops((4, 3, 16), (4, 16, 32)) == 2 * 4 * 3 * 16 * 32  # batched groups
    assert _grouped_mm_flops((16, 12), (12, 32)) == 2 * 16 * 12 * 32  # weight gradient
