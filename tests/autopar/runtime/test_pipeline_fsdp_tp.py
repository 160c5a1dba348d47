"""PP2 x FSDP2 x TP2 on 8 gloo ranks matches one process (TP, FSDP2 from core's per chunk)."""

from __future__ import annotations

import pytest
from pp_harness import PPCase, check


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_fsdp2_tp2_matches_single_process_on_8_ranks():
    check(
        8, [PPCase("gpt-tiny", "1f1b", tp=2, fsdp=2), PPCase("llama-tiny", "gpipe", tp=2, fsdp=2)]
    )
