"""Sharded training matches the single-process run: tiny GPT and Llama (GQA) on 2 gloo ranks.

Every case trains 3 AdamW steps (lr 1e-3, weight decay 0.1, clipping at 1.0) on the same
seeded model and global batch; loss and pre-clip gradient norm after every step must equal
the reference within 1e-5 relative (fp32). One spawn runs every case.
"""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

CONFIGS = {
    "DP2": C(dp=2),
    "ZeRO-1": C(fsdp=2, zero_stage=1),
    "ZeRO-2": C(fsdp=2, zero_stage=2),
    "FSDP (ZeRO-3)": C(fsdp=2, zero_stage=3),
    "TP2": C(tp=2),
    "TP2+SP": C(tp=2, sequence_parallel=True),
    "recompute full, DP2": C(dp=2, recompute="full"),
    "recompute selective, TP2+SP": C(tp=2, sequence_parallel=True, recompute="selective"),
}

# The intra-layer ILP's parameter placements (as `plan.placements` holds them) for a GPT
# block: attention Megatron-split, the MLP's fc column-parallel but its proj replicated, so
# the runtime must gather fc's output to stay exact.
GPT_PLACEMENTS = {
    "GPTBlock": {
        "layer": "blocks.0",
        "parameters": {
            "blocks.0.attn.qkv.weight": "S(0)",
            "blocks.0.attn.qkv.bias": "S(0)",
            "blocks.0.attn.proj.weight": "S(1)",
            "blocks.0.attn.proj.bias": "R",
            "blocks.0.mlp.fc.weight": "S(0)",
            "blocks.0.mlp.fc.bias": "S(0)",
            "blocks.0.mlp.proj.weight": "R",
            "blocks.0.mlp.proj.bias": "R",
        },
    }
}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpt_and_llama_match_single_process_on_2_ranks():
    cases = [Case(model, cfg) for model in ("gpt-tiny", "llama-tiny") for cfg in CONFIGS.values()]
    cases.append(Case("gpt-tiny", C(tp=2), placements=GPT_PLACEMENTS))
    errors = check_cases(2, cases)
    assert len(errors) == len(cases)
