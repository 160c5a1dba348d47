"""The GPT's three attention paths: the same maths, and the ops a trace sees of each."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.estimate import build_tables
from autopar.models import zoo

SEQ, HIDDEN, HEADS = 32, 64, 4


def _model(attention: str, **overrides):
    return zoo.build("gpt-tiny", attention=attention, seq_len=SEQ, hidden=HIDDEN,
                     num_heads=HEADS, **overrides)  # fmt: skip


def test_math_and_megatron_attention_compute_what_the_fused_kernel_does():
    ids = torch.randint(0, 128, (2, SEQ))
    outs, grads = {}, {}
    for attention in ("flash", "math", "megatron"):
        model = _model(attention)  # built from one seed: the same weights
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        outs[attention] = logits.detach()
        grads[attention] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for attention in ("math", "megatron"):
        torch.testing.assert_close(outs[attention], outs["flash"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[attention], grads["flash"], rtol=1e-4, atol=1e-6)


def test_megatron_attention_drops_two_passes_over_the_scores_from_the_trace():
    """Eager attention scales the s x s scores and masks them before the softmax, each a read
    and a write of the scores; Megatron's score GEMM takes the scale and its softmax kernel
    masks as it goes."""
    blocks = {}
    for attention in ("math", "megatron"):
        model = _model(attention, num_layers=1, device="meta")
        graph = autopar.trace(model, zoo.example_inputs("gpt-tiny", model))
        (block,) = [t for t in build_tables(graph).layers if t.name == "blocks.0"]
        blocks[attention] = sum(b for _, b, _ in block.memory_ops)
    score_bytes = HEADS * SEQ * SEQ * 4  # one sample's scores, fp32
    dropped = blocks["math"] - blocks["megatron"]
    # the scale and the mask each read and write the scores; the query's scale (s x d per head)
    # is added back
    assert dropped == pytest.approx(4 * score_bytes - 2 * SEQ * HIDDEN * 4, rel=0.05)


def test_an_unknown_attention_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="flash, math, megatron"):
        _model("sparse")
