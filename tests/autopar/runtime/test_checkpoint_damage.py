"""Damaged checkpoints and failed saves (autopar.runtime.checkpoint), on 2 real gloo ranks.

A 4-step FSDP2 run saves after steps 2 and 4. Then, each on a copy of that directory:
- the step-4 checkpoint damaged (a shard truncated, `.metadata` truncated, a rank's RNG file
  deleted, 4 KiB of a shard flipped with its size unchanged): resume skips it, names what is
  wrong, and continues from step 2 with the losses
  of the uninterrupted run;
- both checkpoints damaged: resume refuses with `CheckpointError` naming both;
- the disk full at the step-4 save (the rank processes' file size limit, RLIMIT_FSIZE, below
  the shards' size: the kernel's EFBIG, as a full disk's ENOSPC): the save raises
  `CheckpointError` with the directory and the bytes, no partial directory is left, and the
  step-2 checkpoint still verifies.
"""

from __future__ import annotations

import contextlib
import io
import resource
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import OPTIONS, Case, run_ranks, task_of

from autopar.config import ParallelConfig
from autopar.runtime.checkpoint import CheckpointError, CheckpointOptions, checkpoint_problem
from autopar.runtime.trainer import train

CASE = Case("gpt-tiny", ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=1), 4)


def _train(steps: int, directory: str) -> list[float]:
    options = replace(OPTIONS, steps=steps, checkpoint=CheckpointOptions(directory, every=2))
    results = train(task_of(CASE), CASE.config, CASE.global_batch_size, options=options)
    return [r.loss for r in results]


def _damage(root: Path, label: str, how: str) -> Path:
    """A copy of the run's checkpoints with step 4 (or both) damaged ``how``."""
    copy = root / label
    shutil.copytree(root / "run", copy)
    steps = ["step-00000004"] + (["step-00000002"] if how == "both" else [])
    for step in steps:
        path = copy / step
        if how in ("shard", "both"):
            shard = sorted(path.glob("*.distcp"))[-1]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        elif how == "metadata":
            meta = path / ".metadata"
            meta.write_bytes(meta.read_bytes()[:40])
        elif how == "rng":
            (path / "rng-rank1.pt").unlink()
        elif how == "flip":  # 4 KiB inverted in the middle, the size unchanged
            shard = sorted(path.glob("*.distcp"))[-1]
            data = bytearray(shard.read_bytes())
            middle = len(data) // 2
            data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
            shard.write_bytes(bytes(data))
    return copy


def _ranks(root_text: str) -> dict[str, object]:
    root = Path(root_text)
    out: dict[str, object] = {"straight": _train(4, str(root / "run"))}
    for how in ("shard", "metadata", "rng", "flip", "both"):
        if dist.get_rank() == 0:
            _damage(root, how, how)
        dist.barrier()
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said):
                out[how] = _train(4, str(root / how))
        except CheckpointError as e:
            out[how] = f"refused: {e}"
        out[f"{how} said"] = said.getvalue()
    # a full disk at the step-4 save of a run resumed from step 2
    if dist.get_rank() == 0:
        shutil.copytree(root / "run", root / "full")
        shutil.rmtree(root / "full" / "step-00000004")
    dist.barrier()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))  # shards: ~600 KiB
    try:
        out["full"] = _train(4, str(root / "full"))
    except CheckpointError as e:
        out["full"] = f"refused: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    dist.barrier()
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_and_a_full_disk_is_named(tmp_path):
    got = run_ranks(2, _ranks, str(tmp_path))[0]
    straight = got["straight"]
    for how, what in (("shard", ".distcp holds"), ("metadata", ".metadata holds"),
                      ("rng", "rng-rank1.pt is missing"),
                      ("flip", ".distcp holds other bytes than were written")):  # fmt: skip
        assert got[how] == straight[2:], how  # resumed after step 2: steps 3 and 4, the same
        assert "step-00000004" in got[f"{how} said"] and what in got[f"{how} said"], got
        assert "damaged" in got[f"{how} said"]
    assert got["both"].startswith("refused: no intact checkpoint"), got["both"]
    assert "step-00000004" in got["both"] and "step-00000002" in got["both"]
    full = got["full"]
    assert full.startswith("refused: saving the checkpoint of step 4 into "), full
    assert str(tmp_path / "full") in full and "bytes" in full
    assert "the checkpoint of step 2 is intact" in full
    assert checkpoint_problem(tmp_path / "full" / "step-00000002") is None
    assert not list((tmp_path / "full").glob(".partial-*"))
