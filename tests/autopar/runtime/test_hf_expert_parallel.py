"""Expert parallelism over Hugging Face expert stacks (`autopar.runtime.hf_experts`) composed
with every other dimension trains as one process on 4 gloo ranks (fp32, 3 steps, loss and
gradient norm within 1e-5), for Mixtral, Qwen3-MoE and DeepSeek-V3 (shared expert, dense first
layer, MLA):
    EP2 x FSDP2 (HSDP over dp=2, ZeRO-3): each layer's experts an FSDP2 unit over the two ranks
                                holding them
    EP2 x TP2 + SP              each tp rank routes its sequence shard's tokens, the routers'
                                and experts' gradients summed over tp; DeepSeek-V3's MLA split
                                by head, its down-projections on the gathered sequence
    EP2 x PP2
    EP4 folded over DP2 x CP2   (the experts left out of the cp gradient sum)
and two where ep covers every data rank, so FSDP leaves the experts out
(`ExpertParallel.shard`): EP2 x FSDP2 x PP2 (Qwen3-MoE) and EP2 x FSDP2 beside TP2 (Mixtral);
and EP2 over CP2 x PP2 (Qwen3-MoE: a pipeline chunk of a Hugging Face model routes its
attention through the whole model's config; the runtime refused CP x PP for them before).
Expert tensor parallelism (etp = tp = 2, `expert_tensor_parallel`: each expert's width split
over the tp ranks, its input and routing gathered over them and its output reduce-scattered,
the all-to-all on every tp rank with the group's tokens) for the three families under EP2 x
TP2 + SP, and Qwen3-MoE under PP2 x TP2 (2026-11-25: 7.5e-8, 1.2e-7, 9.9e-8 and 1.1e-7).
EP2 over DP2 for the three families runs on 2 ranks in test_numerics_cp_ep.py. Measured
(max relative error): the matrix 4.9e-8 to 1.2e-7 (EP2 x TP2 + SP, 2026-11-24: Mixtral 1.1e-7,
Qwen3-MoE 9.9e-8, DeepSeek-V3 9.9e-8); beside it with the same harness,
EP2 over FSDP4 (ZeRO-3) 9.8e-8 to 1.2e-7, EP4 over FSDP4 (ZeRO-1) 1.0e-7, EP2 x FSDP2 x CP2
(ZeRO-3) 9.8e-8 to 1.2e-7, and the zoo MoE under EP x FSDP and EP over CP 7.2e-8 to 8.0e-8."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

FAMILIES = ("mixtral-tiny-hf", "qwen3-moe-tiny-hf", "deepseek-v3-tiny-hf")
MATRIX = (
    C(dp=2, fsdp=2, zero_stage=3, ep=2),
    C(dp=2, tp=2, ep=2),
    C(dp=2, pp=2, ep=2, micro_batch_size=1),
    C(dp=2, cp=2, ep=4),
)


def _sp(config: C) -> C:
    """With tp, sequence parallelism."""
    return replace(config, sequence_parallel=True) if config.tp > 1 else config


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ep_composed_with_fsdp_tp_pp_cp_matches_single_process():
    cases = [Case(m, _sp(c), seq_len=32) for m in FAMILIES for c in MATRIX]
    cases += [
        Case(
            "qwen3-moe-tiny-hf", C(fsdp=2, ep=2, pp=2, micro_batch_size=1, zero_stage=3), seq_len=32
        ),
        Case("mixtral-tiny-hf", C(fsdp=2, tp=2, ep=2, zero_stage=3), seq_len=32),
        Case("qwen3-moe-tiny-hf", C(cp=2, pp=2, ep=2, micro_batch_size=1), seq_len=32),
        *(
            Case(m, C(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True), seq_len=32)
            for m in FAMILIES
        ),  # fmt: skip
        Case("qwen3-moe-tiny-hf", C(tp=2, pp=2, etp=2, micro_batch_size=1), seq_len=32),
    ]
    check_cases(4, cases)
