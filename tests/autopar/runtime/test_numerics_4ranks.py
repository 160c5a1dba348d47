"""Two-dimensional meshes on 4 gloo ranks match the single-process run: DP2xTP2, HSDP, FSDP2xTP2,
CP2xTP2+SP, FSDP2xCP2, EP2 over DP2 with TP2, and DP2xCP2 with EP2."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_dimensional_meshes_match_single_process_on_4_ranks():
    cases = [
        Case("gpt-tiny", C(dp=2, tp=2)),
        Case("llama-tiny", C(dp=2, tp=2, sequence_parallel=True)),
        Case("llama-tiny", C(dp=2, fsdp=2, zero_stage=3)),
        Case("gpt-tiny", C(fsdp=2, tp=2, zero_stage=2)),
        Case("llama-tiny", C(cp=2, tp=2, sequence_parallel=True)),
        Case("gpt-tiny", C(fsdp=2, cp=2, zero_stage=3)),
        Case("moe-tiny", C(dp=2, ep=2, tp=2)),
        Case("moe-tiny", C(dp=2, cp=2, ep=2)),
    ]
    check_cases(4, cases)
