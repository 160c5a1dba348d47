"""PP2 trains exactly as one process: GPT (tied head), Llama, HF Llama and MoE under every torch
schedule (GPipe, 1F1B, interleaved, zero-bubble, ZBV, DualPipeV), uneven cuts, explicit
positions; 2 gloo ranks, one spawn."""

from __future__ import annotations

import pytest
from pp_harness import PPCase, check

CASES = [
    PPCase(model, schedule, v)
    for model in ("gpt-tiny", "llama-tiny")
    for schedule, v in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zero_bubble", 1),
        ("dualpipe_v", 2),
    )
] + [
    PPCase("gpt-tiny", "1f1b", 2, override="zbv"),
    PPCase("llama-tiny", "1f1b", 2, override="zbv"),
    PPCase("gpt-tiny", "1f1b", 1, (("tok_emb", "blocks.0"), ("blocks.1", "blocks.2", "blocks.3"))),
    PPCase(
        "llama-tiny",
        "gpipe",
        1,
        (("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "lm_head")),
    ),
    PPCase("llama-tiny", "interleaved_1f1b", 2, positions=True),
    PPCase("llama-tiny-hf", "1f1b", 1, positions=True),
    PPCase("moe-tiny", "interleaved_1f1b", 2),
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_schedules_match_single_process():
    check(2, CASES)
