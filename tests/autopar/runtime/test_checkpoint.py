"""Checkpoints (autopar.runtime.checkpoint): a resumed run continues bitwise; refusals.

One spawn of 2 gloo ranks runs every multi-rank case (process start-up is the slow part):
uninterrupted 4 steps vs a resume from the step-2 checkpoint of a 4-step run (blocking and
asynchronous saves, FSDP2 and TP2; training went on after the step-2 save began; Mixtral's
expert stacks under EP2 and split over tp under ETP2 + SP, whose slices every rank names alike:
before their keys carried the slice, DCP saved one rank's: resumed, EP2 trained to 4.8191
against 4.8029 at step 3, and ETP2 (zoo MoE) to 4.8636 against 4.8670 at step 4); GPT-2
under TP2, its fused c_attn split piece by piece, resumed under FSDP2 (saved as they were, the
ranks' blocks of it overlapped and DCP refused the save); `keep` pruning, and checkpoints of
another model, global batch or expert layout refused. On 4 ranks, Phi-3's fused projections
under FSDP2 x TP2 resumed under DP2 x TP2. The
directory rules (partial and incomplete checkpoints never resumed) are checked without
processes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import OPTIONS, Case, run_ranks, task_of, tp_of
from test_plan_fidelity import plan_of

from autopar.config import ParallelConfig
from autopar.runtime.checkpoint import (
    CheckpointError,
    CheckpointOptions,
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
)
from autopar.runtime.trainer import train

FSDP2 = Case("gpt-tiny", ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=1), 4)
TP2 = Case("llama-tiny", ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=2), 4)
# each pipeline rank saves only its stage's parameters and optimizer state
HF_EP2 = Case("mixtral-tiny-hf", ParallelConfig(dp=2, ep=2), 4, seq_len=32)
ETP2 = Case("mixtral-tiny-hf", ParallelConfig(tp=2, etp=2, sequence_parallel=True), 4, seq_len=32)
PP2 = Case(
    "llama-tiny",
    ParallelConfig(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch_size=1),
    4,
    overrides={"num_layers": 4},
)


def _run(case: Case, steps: int, ckpt: CheckpointOptions | None) -> list[float]:
    options = replace(OPTIONS, steps=steps, checkpoint=ckpt)
    results = train(
        task_of(case), case.config, case.global_batch_size, options=options, tp=tp_of(case)
    )
    return [r.loss for r in results]


def _cases(root: str, fused: Case, fused_fsdp: Case) -> dict[str, object]:
    out: dict[str, object] = {}
    # a fused projection split piece by piece over tp, resumed under FSDP2 (DCP reshards)
    out["fused"] = _resume_under(f"{root}/fused", fused, fused_fsdp)
    cases = (("fsdp2", FSDP2, False), ("tp2-async", TP2, True), ("pp2", PP2, False),
             ("hf-ep2", HF_EP2, False), ("etp2", ETP2, False))  # fmt: skip
    for label, case, async_save in cases:
        straight = _run(case, 4, None)
        ckpt = CheckpointOptions(f"{root}/{label}", every=2, async_save=async_save)
        first = _run(case, 4, ckpt)  # saves after steps 2 and 4; training goes on after 2
        if dist.get_rank() == 0:  # drop step 4: the step-2 checkpoint must hold step 2's
            shutil.rmtree(Path(root, label, "step-00000004"))  # state, not step 4's (staging)
        dist.barrier()
        resumed = _run(case, 4, ckpt)  # resumes after step 2: computes steps 3 and 4 only
        out[label] = (straight, first, resumed)
    keep = CheckpointOptions(f"{root}/keep", every=1, keep=2)
    _run(FSDP2, 3, keep)
    other = replace(FSDP2, overrides={"num_layers": 3})
    try:
        _run(other, 4, CheckpointOptions(f"{root}/fsdp2"))
        out["other model"] = "accepted"
    except CheckpointError as e:
        out["other model"] = str(e)
    try:
        _run(replace(FSDP2, global_batch_size=8), 4, CheckpointOptions(f"{root}/fsdp2"))
        out["other batch"] = "accepted"
    except CheckpointError as e:
        out["other batch"] = str(e)
    try:  # the experts whole on each tp rank: the checkpoint's are split over tp
        whole = replace(ETP2, config=replace(ETP2.config, etp=1))
        _run(whole, 4, CheckpointOptions(f"{root}/etp2"))
        out["other layout"] = "accepted"
    except CheckpointError as e:
        out["other layout"] = str(e)
    dist.barrier()
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_continues_bitwise_and_refuses_another_model_or_batch(tmp_path):
    got = run_ranks(2, _cases, str(tmp_path), *_fused_cases())[0]
    for label in ("fsdp2", "tp2-async", "pp2", "hf-ep2", "etp2"):
        straight, first, resumed = got[label]
        assert first == straight
        assert [x.hex() for x in resumed] == [x.hex() for x in straight[2:]], label
        meta = read_meta(latest_checkpoint(tmp_path / label))
        assert (meta["step"], meta["samples_seen"], meta["world_size"]) == (4, 16, 2)
        log = [
            json.loads(line) for line in (tmp_path / label / "log.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in log] == [1, 2, 3, 4, 3, 4]  # the resumed run: 3, 4 only
        assert [float.fromhex(r["loss"]) for r in log] == straight + straight[2:]
    assert [s for s, _ in complete_checkpoints(tmp_path / "keep")] == [2, 3]
    assert not list((tmp_path / "keep").glob(".partial-*"))
    message = got["other model"]
    assert "holds a model with fingerprint" in message and "use another --checkpoint-dir" in message
    message = got["other batch"]
    assert "trained with global batch 4 but this run's is 8" in message
    message = got["other layout"]
    assert "holds experts sliced by hand as etp=2, this run as none" in message
    straight, resumed = got["fused"]  # another layout: equal to rounding, not bitwise
    assert max(abs(a - b) / abs(a) for a, b in zip(straight[2:], resumed, strict=True)) < 1e-6


def _resume_under(root: str, saved: Case, resumed: Case) -> tuple[list[float], list[float]]:
    """4 steps of ``saved``, and steps 3-4 of ``resumed`` from ``saved``'s step-2 checkpoint."""
    straight = _run(saved, 4, None)
    ckpt = CheckpointOptions(f"{root}/saved", every=2)
    _run(saved, 2, ckpt)
    return straight, _run(resumed, 4, ckpt)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fused_projections_under_fsdp_and_tp_resume_under_dp_and_tp(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj split piece by piece over tp and FSDP2 sharding the
    tp rank's pieces again, on the same dimension (DTensor's own redistribution of the two
    got the optimizer state wrong: resumed, the loss was 1.1% off), saved on 4 ranks and
    resumed under DP2 x TP2."""
    cases = []
    for config in (ParallelConfig(fsdp=2, tp=2, zero_stage=3, micro_batch_size=1),
                   ParallelConfig(dp=2, tp=2, micro_batch_size=1)):  # fmt: skip
        case = Case("phi3", config, 8, seq_len=16, factory="model_factories:phi3")
        cases.append(replace(case, roles=plan_of(case).tensor_parallel_roles))
    straight, resumed = run_ranks(4, _resume_under, str(tmp_path), *cases)[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(straight[2:], resumed, strict=True)) < 1e-6


def _fused_cases() -> tuple[Case, Case]:
    """GPT-2 (a user's factory) under TP2, its c_attn split piece by piece ("col/3"), and the
    same under FSDP2; with the roles `evaluate` gives them."""
    out = []
    for config in (ParallelConfig(tp=2, micro_batch_size=1),
                   ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=1)):  # fmt: skip
        case = Case("gpt2", config, 8, seq_len=16, factory="model_factories:gpt2")
        out.append(replace(case, roles=plan_of(case).tensor_parallel_roles))
    assert out[0].roles["transformer.h.0.attn.c_attn"] == "col/3", out[0].roles
    return out[0], out[1]


def test_only_complete_checkpoints_are_resumed(tmp_path):
    def make(name: str, meta: bool, metadata: bool) -> None:
        path = tmp_path / name
        path.mkdir()
        if meta:
            (path / "meta.json").write_text(json.dumps({"format": 1, "step": 0}))
        if metadata:
            (path / ".metadata").write_bytes(b"x")

    assert latest_checkpoint(tmp_path / "missing") is None
    make("step-00000002", True, True)
    make("step-00000004", True, True)
    make(".partial-step-00000006", True, True)  # a kill before the rename
    make("step-00000008", False, True)  # no meta.json: not ours / not complete
    make("step-00000010", True, False)  # no DCP metadata
    assert latest_checkpoint(tmp_path) == Path(tmp_path / "step-00000004")
    (tmp_path / "step-00000004" / "meta.json").write_text('{"format": 7}')
    with pytest.raises(CheckpointError, match="format 7"):
        read_meta(tmp_path / "step-00000004")
    (tmp_path / "step-00000004" / "meta.json").write_text('{"format": 1, "ste')
    with pytest.raises(CheckpointError, match="cannot read checkpoint metadata"):
        read_meta(tmp_path / "step-00000004")


def test_options_refuse_bad_numbers():
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointOptions("x", every=2, keep=0)
