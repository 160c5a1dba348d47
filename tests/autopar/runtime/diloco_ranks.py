"""What each rank of the DiLoCo tests runs (importable by the harness's rank processes)."""

from __future__ import annotations

from pathlib import Path

from autopar.config import ParallelConfig
from autopar.models.source import ZOO_FACTORY
from autopar.runtime.checkpoint import CheckpointOptions
from autopar.runtime.data import TokenFile
from autopar.runtime.diloco import DiLoCoGroup
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, train

TOKENS = Path(__file__).resolve().parents[3] / "data" / "tokens" / "autopar-docs.bin"
MODEL = {"name": "llama-tiny", "vocab_size": 256, "seq_len": 32}  # byte-level token file
SEQ, BATCH = 32, 16


def task():
    return task_from_source(
        ZOO_FACTORY, MODEL, global_batch_size=BATCH, seq_len=SEQ,
        data=TokenFile(TOKENS, SEQ, BATCH),
    )  # fmt: skip


def diloco_rank(
    group: int, config: ParallelConfig, steps: int, lighthouse: str, h: int, fragments: int = 1,
    checkpoint: CheckpointOptions | None = None,
):  # fmt: skip
    """One rank of replica group ``group``: (step, loss, outer bytes) per step it ran."""
    diloco = DiLoCoGroup(group, 2, lighthouse, inner_steps=h, fragments=fragments, timeout_s=120)
    options = TrainOptions(steps=steps, lr=3e-3, log=False, diloco=diloco, checkpoint=checkpoint)
    results = train(task(), config, BATCH, options=options)
    return [(r.step, r.loss, r.outer_bytes) for r in results]


def sync_rank(config: ParallelConfig, steps: int):
    """One rank of synchronous data parallelism over all the groups' ranks: loss per step."""
    options = TrainOptions(steps=steps, lr=3e-3, log=False)
    return [r.loss for r in train(task(), config, BATCH, options=options)]
