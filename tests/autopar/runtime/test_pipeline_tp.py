"""Pipeline with tensor parallelism through `trainer.train` on 4 gloo ranks matches one
process: PP2 x TP2, PP2 x TP2 + sequence parallelism (each chunk's own SP ends), PP4, where
the tied embedding's gradient crosses from the first to the last of four stages, PP2 x DP2
(replicated, one gradient all-reduce per chunk), PP2 x CP2 (the shard's positions through the
schedule) and PP2 x DP2 with EP2 (MoE, two chunks per rank)."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

L4 = {"num_layers": 4}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipeline_with_tp_sp_dp_cp_ep_and_pp4_match_single_process_on_4_ranks():
    cases = [
        Case("gpt-tiny", C(pp=2, tp=2, schedule="1f1b"), overrides=L4),
        Case(
            "llama-tiny", C(pp=2, tp=2, schedule="interleaved_1f1b", virtual_stages=2), overrides=L4
        ),
        Case("llama-tiny", C(pp=2, tp=2, sequence_parallel=True, schedule="1f1b"), overrides=L4),
        Case("gpt-tiny", C(pp=2, tp=2, sequence_parallel=True, schedule="gpipe"), overrides=L4),
        Case("gpt-tiny", C(pp=4, schedule="1f1b"), overrides=L4),
        Case(
            "gpt-tiny",
            C(pp=2, dp=2, schedule="interleaved_1f1b", virtual_stages=2),
            8,
            overrides=L4,
        ),
        Case("gpt-tiny", C(pp=2, cp=2, schedule="1f1b"), overrides=L4),
        Case(
            "moe-tiny",
            C(pp=2, dp=2, ep=2, schedule="interleaved_1f1b", virtual_stages=2),
            8,
            overrides=L4,
        ),
    ]
    check_cases(4, cases)
