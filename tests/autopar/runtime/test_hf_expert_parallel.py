"""Expert parallelism over Hugging Face expert stacks (`autopar.runtime.hf_experts`) composed
with the other dimensions trains as one process on 4 gloo ranks: EP2 x PP2 (Qwen3-MoE), EP2
folded over DP2 beside CP2 (DeepSeek-V3: shared expert, dense first layer, MLA) and beside TP2
(Mixtral). EP2 over DP2 for the three families runs on 2 ranks in test_numerics_cp_ep.py.
Measured beside these with the same harness (2026-11-24): EP2 over DP4 (an expert data group
of 2) 1.1e-7; EP2 x PP2 1.5e-7 (Mixtral), 9.9e-8 (DeepSeek-V3); EP2 with CP2 1.2e-7
(Mixtral); EP2 with TP2 9.9e-8 (DeepSeek-V3)."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ep2_composed_with_pp2_cp2_tp2_matches_single_process():
    cases = [
        Case("qwen3-moe-tiny-hf", C(dp=2, ep=2, pp=2, micro_batch_size=1), seq_len=32),
        Case("deepseek-v3-tiny-hf", C(dp=2, cp=2, ep=2), seq_len=32),
        Case("mixtral-tiny-hf", C(dp=2, tp=2, ep=2), seq_len=32),
    ]
    check_cases(4, cases)
