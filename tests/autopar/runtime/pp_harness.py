"""Pipeline numerics harness: the loop a pp > 1 trainer runs, on spawned gloo ranks.

In: `PPCase`s (model, schedule, virtual stages, boundaries, tp, fsdp). Out: per case the
per-step (loss, pre-clip grad norm) of every rank, checked against the single-process run
(`check`, within 1e-5 relative). One spawn per world size runs all its cases.

The loop: AdamW, the pipeline's mean loss, the tied-gradient sum, global-norm clipping with
squared local norms weighted by `trainer._norm_share` and all-reduced over the world; the
reference is `trainer.reference_run` on the whole global batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from harness import OPTIONS, max_rel_error, run_ranks
from torch import nn

from autopar.config import ParallelConfig
from autopar.runtime.data_parallel import apply_data_parallel
from autopar.runtime.mesh import build_mesh
from autopar.runtime.pipeline import build_pipeline
from autopar.runtime.task import HF_FACTORY, ZOO_FACTORY, Task, task_from_source
from autopar.runtime.tensor_parallel import apply_tensor_parallel, tp_plan
from autopar.runtime.trainer import _local, _norm_share, reference_run

BATCH = 4  # 4 micro-batches of 1: DualPipeV needs >= 2 * pp


@dataclass(frozen=True)
class PPCase:
    model: str
    schedule: str
    virtual_stages: int = 1
    stage_layers: tuple[tuple[str, ...], ...] | None = None  # None: the even split
    override: str | None = None  # a SCHEDULES name the config cannot say ("zbv")
    positions: bool = False  # pass arange(S) explicitly, as context parallelism passes a shard's
    tp: int = 1
    fsdp: int = 1
    pp: int = 2

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(
            pp=self.pp,
            tp=self.tp,
            fsdp=self.fsdp,
            zero_stage=3 if self.fsdp > 1 else 0,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
        )

    @property
    def global_batch_size(self) -> int:
        return BATCH * self.fsdp

    @property
    def label(self) -> str:
        cut = (" uneven" if self.stage_layers else "") + (" +positions" if self.positions else "")
        mesh = f"pp{self.pp}{' x fsdp2' if self.fsdp > 1 else ''}{' x tp2' if self.tp > 1 else ''}"
        return f"{self.model} {mesh} {self.override or self.schedule} v{self.virtual_stages}{cut}"


def task_of(model: str, global_batch_size: int) -> Task:
    if model.endswith("-hf"):
        kwargs = {"name": model, "num_hidden_layers": 4}
        return task_from_source(HF_FACTORY, kwargs, global_batch_size=global_batch_size, seq_len=32)
    kwargs = {"name": model, "num_layers": 4}
    return task_from_source(ZOO_FACTORY, kwargs, global_batch_size=global_batch_size)


def train_pp(case: PPCase) -> list[tuple[float, float]]:
    """The trainer's loop for pp > 1 on this rank; per step (loss, pre-clip grad norm).

    TP and FSDP come from core's functions, applied per chunk: the TP plan of the whole model
    (original paths) restricted to the chunk's modules, FSDP2 on the chunk's blocks and root.
    """
    config = case.config
    mesh = build_mesh(config, "cpu")
    task = task_of(case.model, case.global_batch_size)
    model = task.build()
    full_tp = tp_plan(model, config)

    def per_chunk(chunk: nn.Module) -> None:
        held = {name for name, _ in chunk.named_modules()}
        apply_tensor_parallel(chunk, mesh["tp"], {k: v for k, v in full_tp.items() if k in held})
        apply_data_parallel(chunk, chunk.named_blocks(), mesh, config)

    pipe = build_pipeline(
        model,
        mesh,
        config,
        num_microbatches=BATCH,
        loss_fn=task.loss,
        stage_layers=case.stage_layers,
        parallelize_chunk=per_chunk,
        schedule=case.override,
    )
    del model
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(
        params, lr=OPTIONS.lr, betas=OPTIONS.betas, weight_decay=OPTIONS.weight_decay, foreach=False
    )
    world, start = dist.get_world_size(), mesh.data_rank * BATCH
    out = []
    for step in range(OPTIONS.steps):
        inputs, targets = task.batch(step, start, start + BATCH)
        positions = torch.arange(inputs[0].shape[1]) if case.positions else None
        loss = pipe.step(inputs, targets, positions)
        pipe.sync_tied_gradients()
        total = torch.zeros(2, dtype=torch.float64)  # [squared norm, loss], summed over the world
        for p in pipe.norm_parameters():
            if p.grad is not None:
                local = _local(p.grad).double().pow(2).sum()
                total[0] += local * _norm_share(p.grad, config.pp, world)
        total[1] = loss.double() / world  # every rank holds its data rank's mean
        dist.all_reduce(total)
        norm = math.sqrt(total[0].item())
        coef = min(1.0, OPTIONS.max_grad_norm / (norm + 1e-6))
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((total[1].item(), norm))
    return out


def run_all(cases: list[PPCase]) -> list[tuple[list[tuple[float, float]], float]]:
    out = []
    for case in cases:
        t0 = time.perf_counter()
        out.append((train_pp(case), time.perf_counter() - t0))
    return out


def check(world_size: int, cases: list[PPCase]) -> None:
    per_rank = run_ranks(world_size, run_all, cases)
    references = {}
    for i, case in enumerate(cases):
        key = (case.model, case.global_batch_size)
        if key not in references:
            task = task_of(*key)
            runs = reference_run(task, case.global_batch_size, OPTIONS)
            references[key] = [(r.loss, r.grad_norm) for r in runs]
        want = references[key]
        got, seconds = per_rank[0][i]
        assert all(r[i][0] == got for r in per_rank)  # every rank reports the same loss, norm
        err = max_rel_error(got, want)
        print(f"{case.label}: max relative error {err:.1e} ({seconds:.2f} s)")
        assert err <= 1e-5, f"{case.label}: {got} vs {want}"
