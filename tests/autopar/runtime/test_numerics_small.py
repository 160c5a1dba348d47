"""The zoo's MLP and conv net train with DP2 and TP2 exactly as in one process (2 gloo ranks)."""

from __future__ import annotations

import pytest
from harness import Case, check_cases, run_ranks

from autopar.config import ParallelConfig as C
from autopar.runtime.mesh import WorldSizeError, check_world_size


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mlp_and_convnet_match_single_process_with_dp2_and_tp2():
    cases = [
        Case(model, cfg)
        for model in ("mlp-tiny", "convnet-tiny")
        for cfg in (C(dp=2), C(tp=2), C(fsdp=2, zero_stage=3))
    ]
    check_cases(2, cases)


def _build_wrong_mesh() -> str:
    from autopar.runtime.mesh import build_mesh

    try:
        build_mesh(C(dp=2, tp=2))
    except WorldSizeError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_world_size_mismatch_is_refused_naming_both_numbers():
    (message,) = run_ranks(1, _build_wrong_mesh)
    assert "needs 4 ranks" in message and "started 1" in message


def test_check_world_size_message():
    with pytest.raises(WorldSizeError, match=r"needs 8 ranks .* started 4"):
        check_world_size(C(dp=2, tp=2, pp=2), 4)
    check_world_size(C(dp=2), 2)
