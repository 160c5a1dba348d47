"""Expert parallelism over Hugging Face expert stacks (`autopar.runtime.hf_experts`) trains as
one process: Mixtral, Qwen3-MoE and DeepSeek-V3 (shared expert, dense first layer, MLA) built
from their configs, EP2 folded over DP2 on 2 gloo ranks; on 4 ranks EP2 over DP4 (an expert
data group of 2), and EP2 composed with PP2, with CP2 and with TP2. Qwen3's per-head q/k norms
under TP2 see only the rank's heads: their weight gradients are summed over tp (they were
not: 2.9e-5 off one process)."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

MODELS = ("mixtral-tiny-hf", "qwen3-moe-tiny-hf", "deepseek-v3-tiny-hf")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ep2_over_dp2_matches_single_process_for_each_family():
    cases = [Case(m, C(dp=2, ep=2), seq_len=32) for m in MODELS]
    check_cases(2, [*cases, Case("qwen3-moe-tiny-hf", C(tp=2), seq_len=32)])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ep2_composed_with_dp4_pp2_cp2_tp2_matches_single_process():
    cases = [
        Case("mixtral-tiny-hf", C(dp=4, ep=2), seq_len=32),
        Case("qwen3-moe-tiny-hf", C(dp=2, ep=2, pp=2, micro_batch_size=1), seq_len=32),
        Case("deepseek-v3-tiny-hf", C(dp=2, cp=2, ep=2), seq_len=32),
        Case("mixtral-tiny-hf", C(dp=2, tp=2, ep=2), seq_len=32),
    ]
    check_cases(4, cases)
