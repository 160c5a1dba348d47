"""Context and expert parallelism through `trainer.train` on 2 gloo ranks match one process:
CP2 for GPT (learned positions, tied head), Llama (RoPE, GQA) and a Hugging Face Llama; EP2
folded over DP2 for the zoo MoE. Combinations with TP, FSDP and PP run in the 4-rank tests."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp2_and_ep2_match_single_process_on_2_ranks():
    cases = [
        Case("gpt-tiny", C(cp=2, micro_batch_size=2)),
        Case("llama-tiny", C(cp=2)),
        Case("llama-tiny-hf", C(cp=2), seq_len=32),
        Case("moe-tiny", C(dp=2, ep=2)),
        Case("moe-tiny", C(dp=2, ep=2, recompute="full", micro_batch_size=2)),
    ]
    check_cases(2, cases)
