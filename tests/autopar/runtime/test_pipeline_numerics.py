"""PP2 trains exactly as one process: GPT (tied head) and Llama, every torch schedule (2 ranks).

One spawn runs all cases. The loop here is the trainer's for pp > 1 (AdamW, the pipeline's
mean loss, tied-gradient sum, global-norm clipping with the squared norms all-reduced over
pp); the reference is `trainer.reference_run` on the whole global batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from harness import OPTIONS, max_rel_error, run_ranks

from autopar.config import ParallelConfig
from autopar.runtime.mesh import build_mesh
from autopar.runtime.pipeline import build_pipeline
from autopar.runtime.task import HF_FACTORY, ZOO_FACTORY, Task, task_from_source
from autopar.runtime.trainer import reference_run

BATCH = 4  # 4 micro-batches of 1: DualPipeV needs >= 2 * pp


@dataclass(frozen=True)
class PPCase:
    model: str
    schedule: str
    virtual_stages: int = 1
    stage_layers: tuple[tuple[str, ...], ...] | None = None  # None: the even split
    override: str | None = None  # a SCHEDULES name the config cannot say ("zbv")
    positions: bool = False  # pass arange(S) explicitly, as context parallelism passes a shard's

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(pp=2, schedule=self.schedule, virtual_stages=self.virtual_stages)

    @property
    def label(self) -> str:
        cut = (" uneven" if self.stage_layers else "") + (" +positions" if self.positions else "")
        return f"{self.model} pp2 {self.override or self.schedule} v{self.virtual_stages}{cut}"


def task_of(model: str) -> Task:
    if model.endswith("-hf"):
        return task_from_source(
            HF_FACTORY, {"name": model, "num_hidden_layers": 4}, global_batch_size=BATCH, seq_len=32
        )
    return task_from_source(ZOO_FACTORY, {"name": model, "num_layers": 4}, global_batch_size=BATCH)


def train_pp(case: PPCase) -> list[tuple[float, float]]:
    """The trainer's loop for pp > 1 on this rank; per step (loss, pre-clip grad norm)."""
    config = case.config
    mesh = build_mesh(config, "cpu")
    task = task_of(case.model)
    pipe = build_pipeline(
        task.build(),
        mesh,
        config,
        num_microbatches=BATCH,
        loss_fn=task.loss,
        stage_layers=case.stage_layers,
        schedule=case.override,
    )
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(
        params, lr=OPTIONS.lr, betas=OPTIONS.betas, weight_decay=OPTIONS.weight_decay
    )
    out = []
    for step in range(OPTIONS.steps):
        inputs, targets = task.batch(step, 0, BATCH)
        positions = torch.arange(inputs[0].shape[1]) if case.positions else None
        loss = pipe.step(inputs, targets, positions)
        pipe.sync_tied_gradients()
        sq = torch.zeros((), dtype=torch.float64)
        for p in pipe.norm_parameters():
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=mesh.group("pp"))
        norm = math.sqrt(sq.item())
        coef = min(1.0, OPTIONS.max_grad_norm / (norm + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), norm))
    return out


def run_all(cases: list[PPCase]) -> list[tuple[list[tuple[float, float]], float]]:
    out = []
    for case in cases:
        t0 = time.perf_counter()
        out.append((train_pp(case), time.perf_counter() - t0))
    return out


CASES = [
    PPCase(model, schedule, v)
    for model in ("gpt-tiny", "llama-tiny")
    for schedule, v in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zero_bubble", 1),
        ("dualpipe_v", 2),
    )
] + [
    PPCase("gpt-tiny", "1f1b", 2, override="zbv"),
    PPCase("llama-tiny", "1f1b", 2, override="zbv"),
    PPCase("gpt-tiny", "1f1b", 1, (("tok_emb", "blocks.0"), ("blocks.1", "blocks.2", "blocks.3"))),
    PPCase(
        "llama-tiny",
        "gpipe",
        1,
        (("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "lm_head")),
    ),
    PPCase("llama-tiny", "interleaved_1f1b", 2, positions=True),
    PPCase("llama-tiny-hf", "1f1b", 1, positions=True),
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_schedules_match_single_process():
    per_rank = run_ranks(2, run_all, CASES)
    references = {}
    for i, case in enumerate(CASES):
        if case.model not in references:
            references[case.model] = [
                (r.loss, r.grad_norm) for r in reference_run(task_of(case.model), BATCH, OPTIONS)
            ]
        want = references[case.model]
        got, seconds = per_rank[0][i]
        assert per_rank[1][i][0] == got  # both pp ranks report the same loss and norm
        err = max_rel_error(got, want)
        print(f"{case.label}: max relative error {err:.1e} ({seconds:.2f} s)")
        assert err <= 1e-5, f"{case.label}: {got} vs {want}"
