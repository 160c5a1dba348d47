"""PP2 through `trainer.train` trains exactly as one process: GPT (tied head), Llama, HF Llama
and MoE under every torch schedule (GPipe, 1F1B, interleaved, zero-bubble, ZBV, DualPipeV) and
uneven cuts given as the plan's stage layer lists, the embedding and the head in chunks of
their own (pipeline slots), full and selective recompute inside the
chunks; 2 gloo ranks, one spawn."""

from __future__ import annotations

import pytest
from harness import Case, check_cases

from autopar.config import ParallelConfig as C

L4 = {"num_layers": 4}  # 4 micro-batches of 1: DualPipeV needs >= 2 * pp


def pp2(model: str, planned: str, v: int = 1, recompute: str = "none", **kwargs) -> Case:
    overrides = {"num_hidden_layers": 4} if model.endswith("-hf") else L4
    seq_len = 32 if model.endswith("-hf") else None
    config = C(pp=2, schedule=planned, virtual_stages=v, recompute=recompute)
    return Case(model, config, overrides=overrides, seq_len=seq_len, **kwargs)


CASES = (
    [
        pp2(model, schedule, v)
        for model in ("gpt-tiny", "llama-tiny")
        for schedule, v in (
            ("gpipe", 1),
            ("1f1b", 1),
            ("interleaved_1f1b", 2),
            ("zero_bubble", 1),
            ("dualpipe_v", 2),
        )
    ]
    + [
        pp2("gpt-tiny", "1f1b", 2, schedule="zbv"),
        pp2(
            "gpt-tiny",
            "1f1b",
            stage_layers=(("tok_emb", "blocks.0"), ("blocks.1", "blocks.2", "blocks.3")),
        ),
        pp2(
            "llama-tiny",
            "gpipe",
            stage_layers=(
                ("embed_tokens", "layers.0", "layers.1", "layers.2"),
                ("layers.3", "lm_head"),
            ),
        ),
        pp2("llama-tiny-hf", "1f1b"),
        pp2("moe-tiny", "interleaved_1f1b", 2),
        pp2("gpt-tiny", "1f1b", recompute="full"),
        pp2("llama-tiny", "interleaved_1f1b", 2, recompute="selective"),
    ]
    + [  # the embedding and the loss in chunks of their own (pipeline slots): 2 blocks, 4 chunks
        Case(
            model,
            C(pp=2, schedule=schedule, virtual_stages=2, pipeline_slots=("embedding", "loss")),
            overrides={"num_layers": 2},
        )
        for model, schedule in (("gpt-tiny", "interleaved_1f1b"), ("llama-tiny", "dualpipe_v"))
    ]
)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_schedules_match_single_process():
    check_cases(2, CASES)
