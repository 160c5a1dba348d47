"""Context and expert parallelism through `trainer.train` on 2 gloo ranks match one process:
CP2 for GPT (learned positions, tied head), Llama (RoPE, GQA) and a Hugging Face Llama (also
with the plan's ring attention, `cp_attention`); EP2
folded over DP2 for the zoo MoE and for transformers' stacked experts (Mixtral, Qwen3-MoE,
DeepSeek-V3 with its shared expert, dense first layer and MLA: `autopar.runtime.hf_experts`);
and Qwen3-MoE under TP2, whose per-head q/k norms see only the rank's heads (their weight
gradients summed over tp: they were not, 2.9e-5 off one process); expert tensor parallelism
(etp = tp = 2: each expert's width split over the tp ranks, `expert_tensor_parallel`) for the
zoo MoE (its dense combine) and Mixtral with SP (2026-11-25: 9.9e-8 and 7.3e-8; that the
experts are split, the plan's parameter bytes per rank say: test_plan_fidelity.py).
Combinations with TP, FSDP and PP run in the 4-rank tests (test_hf_expert_parallel.py for the
Hugging Face MoE)."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

HF_MOE = ("mixtral-tiny-hf", "qwen3-moe-tiny-hf", "deepseek-v3-tiny-hf")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp2_and_ep2_match_single_process_on_2_ranks():
    cases = [
        Case("gpt-tiny", C(cp=2, micro_batch_size=2)),
        Case("llama-tiny", C(cp=2)),
        Case("llama-tiny-hf", C(cp=2), seq_len=32),
        # the plan's ring (cp_attention) through the trainer, on a Hugging Face decoder
        Case("llama-tiny-hf", C(cp=2, cp_attention="ring"), seq_len=32),
        Case("moe-tiny", C(dp=2, ep=2)),
        Case("moe-tiny", C(dp=2, ep=2, recompute="full", micro_batch_size=2)),
        *(Case(m, C(dp=2, ep=2), seq_len=32) for m in HF_MOE),
        Case("qwen3-moe-tiny-hf", C(tp=2), seq_len=32),
        Case("moe-tiny", C(tp=2, etp=2)),
        Case("mixtral-tiny-hf", C(tp=2, etp=2, sequence_parallel=True), seq_len=32),
    ]
    check_cases(2, cases)
