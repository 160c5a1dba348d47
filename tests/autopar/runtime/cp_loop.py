"""A training loop for the context-parallel variants the trainer does not select.

`autopar.runtime.trainer.train` runs context parallelism with the default `CPOptions`
(all-gather KV, load-balanced shards); this loop does the same steps (module docstring of
the trainer) for dp (replicated) x cp with any `CPOptions`, so the ring attention and the
contiguous layout are checked end to end: per micro-batch `ContextParallel.shard_batch /
forward / loss`, after backward `ContextParallel.sync_gradients` (sum over cp), the dp
average, the global norm, clipping, AdamW. Ranks are laid out [dp, cp] as
`autopar.runtime.mesh`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from harness import OPTIONS, Case, task_of

from autopar.runtime.context_parallel import CPOptions, apply_context_parallel


def _groups(dp: int, cp: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(dp group, cp group) of this rank, or None where the degree is 1."""
    layout = torch.arange(dp * cp).reshape(dp, cp)
    me, out = dist.get_rank(), [None, None]
    for axis, rows in ((0, layout.T.tolist()), (1, layout.tolist())):
        if layout.shape[axis] == 1:
            continue
        for ranks in rows:
            group = dist.new_group(ranks)
            if me in ranks:
                out[axis] = group
    return out[0], out[1]


def _average(grads: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_cp(case: Case, cp_options: CPOptions | None = None) -> list[tuple[float, float]]:
    """Train ``case`` (config dp, cp, micro_batch_size) on this rank; per step
    (global loss, pre-clip global gradient norm)."""
    cfg, world = case.config, dist.get_world_size()
    if world != cfg.dp * cfg.cp:
        raise ValueError(f"cp_ep_loop runs dp x cp = {cfg.dp * cfg.cp} ranks, got {world}")
    task = task_of(case)
    model = task.build()
    dp_group, cp_group = _groups(cfg.dp, cfg.cp)
    cp = apply_context_parallel(model, cp_group, cp_options) if cp_group else None
    options = OPTIONS
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=options.lr,
        betas=options.betas,
        weight_decay=options.weight_decay,
        foreach=False,
    )
    per_rank = case.global_batch_size // cfg.dp
    num_micro = per_rank // cfg.micro_batch_size
    start = (dist.get_rank() // cfg.cp) * per_rank
    out = []
    for step in range(options.steps):
        inputs, targets = task.batch(step, start, start + per_rank)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i in range(num_micro):
            mb = slice(i * cfg.micro_batch_size, (i + 1) * cfg.micro_batch_size)
            x, y = tuple(t[mb] for t in inputs), targets[mb]
            if cp is not None:
                x, y, pos = cp.shard_batch(x, y)
                loss = cp.loss(cp.forward(model, x, pos), y) / num_micro
            else:
                loss = task.loss(task.forward(model, x), y) / num_micro
            loss.backward()
            loss_sum += loss.detach().double()
        if cp is not None:
            cp.sync_gradients(model)
        if dp_group is not None:
            _average([p.grad for p in model.parameters() if p.grad is not None], dp_group, cfg.dp)
        total = torch.zeros(2, dtype=torch.float64)
        for p in model.parameters():
            if p.grad is not None:  # every parameter is replicated: each rank counts 1/world
                total[0] += p.grad.double().pow(2).sum() / world
        total[1] = loss_sum / world
        dist.all_reduce(total)
        norm = math.sqrt(total[0].item())
        coef = min(1.0, options.max_grad_norm / (norm + 1e-6))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((total[1].item(), norm))
    return out


def run_loop_cases(cases: list[tuple[Case, CPOptions | None]]) -> list[list[tuple[float, float]]]:
    return [train_cp(case, options) for case, options in cases]
