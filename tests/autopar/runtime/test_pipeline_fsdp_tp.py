"""PP2 x FSDP2 x TP2 through `trainer.train` on 8 gloo ranks matches one process (per chunk:
TP, FSDP2 of its blocks and root), with sequence parallelism on the Llama case."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

L4 = {"num_layers": 4}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_fsdp2_tp2_matches_single_process_on_8_ranks():
    cases = [
        Case("gpt-tiny", C(pp=2, fsdp=2, tp=2, zero_stage=3, schedule="1f1b"), 8, overrides=L4),
        Case(
            "llama-tiny",
            C(pp=2, fsdp=2, tp=2, zero_stage=2, sequence_parallel=True, schedule="gpipe"),
            8,
            overrides=L4,
        ),
    ]
    check_cases(8, cases)
