"""Causal attention is counted at the FLOPs its kernels do: torch's FLOP counter prices
scaled_dot_product_attention as the whole L x S score matrix, while flash-style kernels given
``is_causal`` skip the blocks above the diagonal (`autopar.tracing.ops._causal_share`). Checked
against the same call without the flag, the exact share sum_i min(i + 1, S) / (L S), a call
with an explicit mask (counted whole), and a Hugging Face Llama, whose "sdpa" attention passes
``is_causal`` where it makes no mask, while a sliding-window layer keeps its mask whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.models import hf
from autopar.tracing.ops import _causal_share

HEADS, DIM = 4, 16


class Attend(nn.Module):
    def __init__(self, causal: bool, masked: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.causal, self.masked = causal, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        mask = None
        if self.masked:  # a causal mask handed over as a tensor
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal).sum()


def _attention_flops(model: nn.Module, seq: int) -> tuple[float, float]:
    graph = autopar.trace(model, (torch.randn(2, seq, HEADS * DIM),))
    nodes = [n for n in graph.nodes.values() if n.op_class == "attention"]
    assert nodes, "no attention node traced"
    return sum(n.flops for n in nodes), sum(n.backward_flops for n in nodes)


@pytest.mark.parametrize("seq", [7, 64])
def test_a_causal_call_counts_the_lower_triangle(seq):
    full = _attention_flops(Attend(causal=False), seq)
    causal = _attention_flops(Attend(causal=True), seq)
    share = (seq + 1) / (2 * seq)
    assert causal[0] == pytest.approx(full[0] * share)
    assert causal[1] == pytest.approx(full[1] * share)
    assert full[0] == pytest.approx(2 * 2 * 2 * HEADS * seq * seq * DIM)  # QK^T and PV, batch 2
    # an explicit mask is counted whole: kernels given a mask tensor compute every block
    assert _attention_flops(Attend(causal=False, masked=True), seq) == pytest.approx(full)


def test_the_share_follows_torchs_top_left_mask_for_unequal_lengths():
    op = torch.ops.aten.scaled_dot_product_attention.default

    def share(rows: int, cols: int, causal: bool = True) -> float:
        q, k = torch.empty(1, 1, rows, 8), torch.empty(1, 1, cols, 8)
        return _causal_share(op, (q, k, k), {"is_causal": causal})

    mask = lambda r, c: torch.ones(r, c).tril().mean().item()  # noqa: E731
    for rows, cols in ((5, 5), (3, 8), (8, 3), (1, 4)):
        assert share(rows, cols) == pytest.approx(mask(rows, cols))
    assert share(6, 6, causal=False) == 1.0
    assert _causal_share(torch.ops.aten.mm.default, (), {}) == 1.0


def test_a_hugging_face_llama_counts_its_attention_causal():
    model = hf.build("llama-tiny-hf", device="meta")
    seq = 32
    graph = autopar.trace(model, (torch.randint(0, 100, (1, seq), device="meta"),))
    c = model.config
    nodes = [n for n in graph.nodes.values() if n.op_class == "attention"]
    assert len(nodes) == c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    whole = 2 * 2 * c.num_attention_heads * seq * seq * head_dim
    assert all(n.flops == pytest.approx(whole * (seq + 1) / (2 * seq)) for n in nodes)


def test_a_sliding_window_layer_is_counted_whole():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, sliding_window=8,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = MistralForCausalLM(config)
    seq = 32
    graph = autopar.trace(model, (torch.randint(0, 100, (1, seq), device="meta"),))
    (node,) = [n for n in graph.nodes.values() if n.op_class == "attention"]
    assert node.flops == 2 * 2 * 4 * seq * seq * 16  # the window's mask runs every block
