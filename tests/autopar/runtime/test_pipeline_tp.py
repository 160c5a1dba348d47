"""PP2 x TP2 on 4 gloo ranks matches one process (TP from core's functions per chunk)."""

from __future__ import annotations

import pytest
from pp_harness import PPCase, check


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_with_tp2_matches_single_process_on_4_ranks():
    check(
        4,
        [
            PPCase("gpt-tiny", "1f1b", tp=2),
            PPCase("llama-tiny", "interleaved_1f1b", 2, tp=2),
        ],
    )
