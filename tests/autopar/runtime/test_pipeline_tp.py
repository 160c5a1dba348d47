"""PP2 x TP2 on 4 gloo ranks matches one process (TP from core's functions per chunk); so does
PP4, where the tied embedding's gradient crosses from the first to the last of four stages."""

from __future__ import annotations

import pytest
from pp_harness import PPCase, check


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_tp2_and_pp4_match_single_process_on_4_ranks():
    check(
        4,
        [
            PPCase("gpt-tiny", "1f1b", tp=2),
            PPCase("llama-tiny", "interleaved_1f1b", 2, tp=2),
            PPCase("gpt-tiny", "1f1b", pp=4),
        ],
    )
