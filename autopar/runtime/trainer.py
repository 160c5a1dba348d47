"""The training loop generated programs and tests run: a Task + a plan's config -> step results.

In: a `Task` (model factory, loss, data), the plan's `ParallelConfig`, the global batch, the
plan's placements and predictions, `TrainOptions`. Out: per step the global-batch loss, the
pre-clip global gradient norm, the measured step time and this rank's memory; each step is
printed next to the plan's prediction.

One step, on every rank:
    for each of the rank's micro-batches:  loss_mb = loss(model(x_mb), y_mb) / num_micro
                                           loss_mb.backward()     (ZeRO-1 syncs on the last)
    data-parallel gradient sync            (explicit all-reduce for dp; FSDP2 reduce-scatters)
    norm^2 = sum_p sum(local grad_p^2) * share_p, all-reduced over the world, where share_p =
             (distinct shards of p) * pp / world counts every replica once (DTensor placements
             say which mesh axes shard p; a parameter lives on one pipeline stage)
    grads *= min(1, max_norm / (norm + 1e-6))   (torch.nn.utils.clip_grad_norm_'s formula)
    AdamW step at the step's learning rate (`TrainOptions.lr_at`: warmup, constant or cosine)
The loss printed is the global-batch mean: mean over micro-batches, then over data ranks;
with `TrainOptions.metrics_path` rank 0 logs each step beside the plan (`runtime.metrics`).

With pp > 1 (`autopar.runtime.pipeline`) the model is cut at the plan's stage boundaries into
this rank's chunks, each parallelised as above (its own TP plan, recompute, FSDP); torch's
schedule runs the micro-batches' forwards and backwards (and drives FSDP's gradient sync:
no per-micro-batch ZeRO-1 switch), then a tied embedding's gradients are summed over the
first and last stage, and the loop goes on with the data-parallel sync as above; the norm
skips the last stage's copy of a tied weight, and the pipeline hands every stage the loss.

Context parallelism (cp > 1, `autopar.runtime.context_parallel`): the model runs as one
`stages.StageModule` (original paths) so that a micro-batch's sequence shard goes in at its
global positions; the loss is the shard's share of the micro-batch's token mean (its value
the whole mean), and after backward every gradient is summed over cp, before the
data-parallel sync. No vocabulary split of the head (the cp loss reads whole logits).
Expert parallelism (ep > 1, `autopar.runtime.expert_parallel`, folded over the dp x fsdp x cp
token ranks): each rank keeps num_experts/ep experts and dispatches tokens by all-to-all; the
experts' gradients are summed over their replicas (FSDP2 units of their own with fsdp > 1) and
divided by the data ranks (left out of the cp sum and the dp average), and their norm share
is ep times a replicated parameter's.

Data: data rank r of D = dp*fsdp gets samples [r*B/D, (r+1)*B/D) of the step's global batch,
split into consecutive micro-batches of `micro_batch_size`.

Parallelisation (`autopar.runtime.parallelize`, as torchtitan): pipeline split ->
tensor/sequence parallel -> context parallel -> expert parallel -> recompute -> FSDP2 /
replication, from the modules `pipeline`, `tensor_parallel`, `context_parallel`,
`expert_parallel`, `recompute`, `data_parallel` of this package.

Public functions:
    TrainOptions, StepResult, Prediction
    parallelize_model, ParallelModel, PipelineSpec    # from autopar.runtime.parallelize
    train(task, config, global_batch_size, ..., stage_layers=None) -> list[StepResult]
    reference_run(task, global_batch_size, options) -> list[StepResult]   # plain single process
    reference_model(task, global_batch_size, options) -> (steps, the trained model)
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.config import ParallelConfig
from autopar.config.precision import ALIASES
from autopar.runtime.checkpoint import CheckpointOptions, open_checkpointer
from autopar.runtime.collectives import ROUTED_ROWS, local_shard
from autopar.runtime.hf_export import save_run_as_hf
from autopar.runtime.host_memory import release_freed_memory
from autopar.runtime.low_precision import RUNTIME_PRECISIONS
from autopar.runtime.mesh import RuntimeMesh, build_mesh
from autopar.runtime.metrics import Metrics
from autopar.runtime.parallelize import (  # noqa: F401  (parallelize_model: re-exported)
    ParallelModel,
    PipelineSpec,
    parallelize_model,
)
from autopar.runtime.preflight import (
    check_batch,
    check_finite,
    check_loss,
    check_options,
    skip_nonfinite,
)
from autopar.runtime.replicas import DiLoCoGroup, FTGroup, ReplicaRun, replica_share
from autopar.runtime.run_report import print_rank_summary, step_line
from autopar.runtime.startup.start import (
    WeightsFrom,
    build_whole,
    process_age_s,
    start_model,
)
from autopar.runtime.task import Task
from autopar.runtime.tp_apply import loss_context, reduce_partial_grads

MiB = 2**20


@dataclass(frozen=True)
class TrainOptions:
    """How to train: steps, AdamW, clipping, seed, precision, device, printing."""

    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 0
    # "fp32"; "bf16": autocast forward, fp32 master weights; a low-precision recipe
    # (`autopar.config.precision`, "fp8-tensorwise", "fp8-rowwise"): bf16, with the blocks'
    # linears converted by torchao (`autopar.runtime.low_precision`)
    precision: str = "fp32"
    device: str | None = None  # None: cuda when available, else cpu
    log: bool = True
    # autopar.runtime.checkpoint: save every N steps, resume from the newest complete one
    checkpoint: CheckpointOptions | None = None
    # learning rate: linear warmup over warmup_steps, then constant or cosine decay to
    # min_lr_ratio x lr at the last step; a function of the step, so resuming needs no state
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # or "cosine"
    min_lr_ratio: float = 0.1
    # rank 0 appends one JSON line per step here (`Metrics`), and TensorBoard scalars to
    # tensorboard_dir where the tensorboard package is installed
    metrics_path: str | None = None
    tensorboard_dir: str | None = None
    # torch.compile each block (`parallelize_model`'s compile_blocks; the "autopar-compile"
    # stack prices it)
    compile: bool = False
    # a Hugging Face checkpoint directory to start from (`startup.hf_checkpoint`); None: the
    # factory's initialization under `seed`
    init_from: str | None = None
    # write the trained model here as a Hugging Face checkpoint after the last step
    # (`autopar.runtime.hf_export`)
    save_hf: str | None = None
    # CPU ranks: glibc's malloc made to return freed tensor memory, so the resident set is
    # the live tensors the plan prices, at some cost in step time (`autopar.runtime.host_memory`)
    release_host_memory: bool = False
    # skip up to this many steps whose loss or gradient norm is not finite (no optimizer step,
    # their gradients dropped, their samples consumed); 0: the first such step stops the run
    skip_nonfinite: int = 0
    # this rank's replica group over torchft, DiLoCo's or fault-tolerant (`runtime.replicas`)
    diloco: DiLoCoGroup | None = None
    ft: FTGroup | None = None

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based step ``step``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        low = self.lr * self.min_lr_ratio
        return low + (self.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Prediction:
    """The plan's figures the program prints beside its measurements."""

    step_time_s: float | None = None
    stage_memory_bytes: tuple[dict[str, float], ...] = ()
    stage_peak_bytes: tuple[float, ...] = ()
    mfu: float | None = None  # at the predicted step time; measured MFU scales by the ratio
    tokens_per_step: int | None = None
    moe_imbalance: float | None = None  # the expert load priced for the busiest ep rank


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    grad_norm: float  # before clipping
    step_time_s: float
    memory_bytes: dict[str, float] = field(default_factory=dict)  # this rank's
    # expert parallelism: the rows this rank's all-to-alls sent and received this step
    # (`collectives.RoutedRows`); (0, 0) without ep
    routed_rows: tuple[int, int] = (0, 0)
    outer_bytes: float = 0.0  # DiLoCo: the bytes this rank sent other groups this step


def _norm_share(grad: torch.Tensor, pp: int, world: int) -> float:
    """The weight of this rank's squared local gradient in the world sum (module docstring)."""
    shards = 1
    if isinstance(grad, DTensor):
        for dim, placement in enumerate(grad.placements):
            if placement.is_partial():
                raise RuntimeError("a gradient is still Partial after the data-parallel sync")
            # FSDP over TP shards a dim twice: the fsdp axis' placement is a _StridedShard,
            # which is not a Shard subclass (is_shard() is False) but splits all the same
            if placement.is_shard() or isinstance(placement, _StridedShard):
                shards *= grad.device_mesh.size(dim)
    return shards * pp / world


def memory_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes (local shards) and peak."""
    params = list(model.parameters())
    out = {
        "parameters": float(sum(local_shard(p).numel() * p.element_size() for p in params)),
        "gradients": float(
            sum(
                local_shard(p.grad).numel() * p.grad.element_size()
                for p in params
                if p.grad is not None
            )
        ),
        "optimizer": 0.0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step count
                    out["optimizer"] += local_shard(value).numel() * value.element_size()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak"] = float(torch.cuda.max_memory_allocated())
        # what the caching allocator held at most: the figure an OOM is decided on, and the
        # one the plan's peak (live bytes plus its allocator reserve) stands for
        out["peak_reserved"] = float(torch.cuda.max_memory_reserved())
    else:  # Linux reports the peak resident set in KiB
        out["peak"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def _make_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    # foreach=False: parameters may be DTensors on different meshes (TP 1-D, FSDP 2-D) and
    # plain tensors at once; the per-parameter loop handles every mix
    return torch.optim.AdamW(
        model.parameters(),
        lr=options.lr,
        betas=options.betas,
        weight_decay=options.weight_decay,
        foreach=False,
    )


def train(
    task: Task,
    config: ParallelConfig,
    global_batch_size: int,
    *,
    options: TrainOptions | None = None,
    placements: dict | None = None,
    prediction: Prediction | None = None,
    mesh: RuntimeMesh | None = None,
    tp: dict[str, str] | None = None,
    fingerprint: str = "",
    stage_layers: Sequence[Sequence[str]] | None = None,
    schedule: str | None = None,
) -> list[StepResult]:
    """Train ``task`` under ``config`` for ``options.steps`` steps on this rank's share.

    ``tp``: an explicit TP plan (see `parallelize_model`); ``fingerprint``: the plan's model
    fingerprint, checked against the built model. pp > 1: ``stage_layers`` the plan's stage
    boundaries (`[s.layers for s in plan.stages]`; None: the even split), ``schedule`` a
    `pipeline.SCHEDULES` name overriding config.schedule.

    Must run on every rank of a process group whose size is ``config.world_size`` (started by
    torchrun, or by the test harness); the mesh is built when not given.

    Raises:
        WorldSizeError: the world size differs from the plan's.
        ValueError: the global batch does not split into the plan's micro-batches.
    """
    options = options or TrainOptions()
    prediction = prediction or Prediction()
    mesh = mesh or build_mesh(config, options.device)
    global_batch_size, offset = replica_share(options, global_batch_size)  # DiLoCo/ft: a share
    num_data, mbs = mesh.num_data_ranks, config.micro_batch_size
    if global_batch_size % (num_data * mbs):
        raise ValueError(
            f"global batch {global_batch_size} is not a multiple of data ranks {num_data} x "
            f"micro_batch_size {mbs}"
        )
    per_rank = global_batch_size // num_data
    num_micro = per_rank // mbs
    device = torch.device(mesh.mesh.device_type)
    check_options(options)  # a bad option or path stops every rank before the startup

    spec = None
    if config.pp > 1:  # a model cut from its trace: how it is called, one micro-batch (on
        # the meta device, as the model is when it is cut)
        example = tuple(t[:mbs].to("meta") for t in task.batch(0, 0, mbs)[0])
        spec = PipelineSpec(num_micro, task.loss, stage_layers, schedule, (task.forward, example))

    # STARTUP (autopar.runtime.startup): built on meta, parallelised, this rank's shards made
    started = start_model(
        task,
        config,
        mesh,
        precision=options.precision,
        placements=placements,
        tp=tp,
        pipeline=spec,
        compile_blocks=options.compile,
        fingerprint=fingerprint,
        seed=options.seed,
        weights=WeightsFrom(options.init_from) if options.init_from else None,
    )
    pm, low, fingerprint = started.model, started.low, started.fingerprint
    # a CPU rank's allocator: whether freed memory goes back (None: not a CPU run); set after
    # the startup, whose many short-lived tensors it would slow 2-3x (its peak is the rank's
    # shards either way)
    released = None
    if device.type == "cpu":
        released = options.release_host_memory and release_freed_memory()
        if options.release_host_memory and not released and options.log and mesh.rank == 0:
            print("[autopar] --release-host-memory: not glibc's malloc, left as it is", flush=True)
    model = pm.model  # pp > 1: this rank's chunks (the rest of the model was never made)
    optimizer = _make_optimizer(model, options)
    # CHECKPOINT (autopar.runtime.checkpoint): resume from the newest complete checkpoint
    checkpoint = ReplicaRun.checkpoint(options, options.log and mesh.rank == 0)  # a group's own
    ckpt = open_checkpointer(
        checkpoint,
        model,
        optimizer,
        global_batch_size=global_batch_size,
        plan_text=config.as_text(),
        fingerprint=fingerprint,  # the whole model's (pp > 1 holds chunks only)
        **_sliced_by_hand(pm, config),
    )
    first_step = ckpt.resume() if ckpt else 0
    every = checkpoint.every if checkpoint else 0
    remaining = options.steps - first_step
    if every and 0 < remaining < every and options.log and mesh.rank == 0:
        print(
            f"[autopar] checkpoints every {every} steps: steps {first_step + 1}-{options.steps} "
            "save none (a shorter --checkpoint-every, or more --steps, to save)",
            flush=True,
        )
    fewer = _held_fewer(pm, config)  # the gradient norm's weights: the parameters stay put
    world, start = dist.get_world_size(), offset + mesh.data_rank * per_rank
    replicas = ReplicaRun(options, pm, optimizer, mesh.rank, world, first_step, ckpt)
    check_batch(task, start, start + per_rank, _reads_token_ids(model))
    if options.log and mesh.rank == 0:
        print(f"[autopar] {started.report.as_text()}", flush=True)
        print(f"[autopar] {mesh.as_text()}; {pm.data_parallel.as_text()}", flush=True)
        if pm.pipeline is not None:
            print(f"[autopar] {pm.pipeline.as_text()}", flush=True)
        if low is not None:
            print(f"[autopar] {low.describe()}", flush=True)
        if options.compile:  # the first step includes compiling: expect it slow
            print(f"[autopar] torch.compile: each of the {len(pm.blocks)} blocks", flush=True)
    results = []
    first_step_s = None
    metrics = Metrics.open(options, prediction) if mesh.rank == 0 else None
    skipped = 0  # non-finite steps skipped so far (options.skip_nonfinite allows how many)
    for step in replicas.steps(first_step, options.steps):
        t0 = time.perf_counter()
        ROUTED_ROWS.take()  # this step's rows only
        inputs, targets = task.batch(step, start, start + per_rank)
        if pm.pipeline is None:
            loss_sum = _accumulate(pm, task, inputs, targets, num_micro, device, options)
        else:  # the schedule runs every micro-batch's forward and backward
            args = (tuple(t.to(device) for t in inputs), targets.to(device), None)
            if pm.context_parallel is not None:  # this rank's sequence shard and positions
                args = pm.context_parallel.shard_batch(args[0], args[1])
            # loss_parallel() for a vocabulary-split head: the schedule runs the loss and its
            # backward inside step()
            with _autocast(device, options.precision), loss_context(pm.tp_plan):
                loss_sum = pm.pipeline.step(*args).double()
        # SP norms: weight-grad all-reduce over tp; a vocabulary-split embedding's gradient
        # made its rows (before the tied sum, which adds it to the head's rows)
        reduce_partial_grads(model)
        if pm.pipeline is not None:  # a tied embedding: first + last stage summed
            pm.pipeline.sync_tied_gradients()
        if pm.context_parallel is not None:  # each cp rank holds its shard's terms: sum
            experts = pm.expert_parallel.expert_names if pm.expert_parallel else frozenset()
            pm.context_parallel.sync_gradients(model, skip=experts)
        if pm.expert_parallel is not None:  # experts: sum over their replicas, / data ranks
            pm.expert_parallel.sync_gradients(model)
        for data_parallel in pm.data_parallels:  # one per pipeline chunk
            data_parallel.sync_gradients()
        replicas.sync_gradients()  # ft groups: averaged over the groups alive
        # a tied embedding's copy on the last stage is counted once (pipeline.norm_parameters)
        counted = model.parameters() if pm.pipeline is None else pm.pipeline.norm_parameters()
        grad_norm, mean_loss = _global_norm_and_loss(counted, loss_sum, mesh, world, fewer)
        log = options.log and mesh.rank == 0
        if skip_nonfinite(step + 1, mean_loss, grad_norm, options.skip_nonfinite - skipped, log):
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        if not replicas.commit(step, log):  # a replica group failed mid-step: dropped
            optimizer.zero_grad(set_to_none=True)
            continue
        where = checkpoint.directory if checkpoint else None
        check_finite(step + 1, mean_loss, grad_norm, where)  # every rank: the same numbers
        coef = min(1.0, options.max_grad_norm / (grad_norm + 1e-6))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    local_shard(p.grad).mul_(coef)
        lr = options.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sent = replicas.bytes_sent
        optimizer.step()  # DiLoCo: its post-step hook takes the outer step every H
        sent = replicas.bytes_sent - sent
        if device.type == "cuda":  # the step's kernels done: the time is the step's own
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0
        memory = memory_of(model, optimizer)  # before zero_grad: gradients still held
        optimizer.zero_grad(set_to_none=True)
        routed = ROUTED_ROWS.take()
        results.append(StepResult(step + 1, mean_loss, grad_norm, step_time, memory, routed, sent))
        if first_step_s is None:  # time to first step: from the process's start
            first_step_s = process_age_s()
        if options.log and mesh.rank == 0:
            print(step_line(results[-1], options.steps, prediction, mesh.pp_rank), flush=True)
        if metrics is not None:
            metrics.write(results[-1], lr)
        if ckpt:  # CHECKPOINT: log the step, save when due
            ckpt.after_step(replicas.done(step + 1), mean_loss, grad_norm)
    replicas.close(options.log)  # DiLoCo's hooks off; torchft's manager shut down
    if ckpt:
        ckpt.close()  # completes a pending asynchronous save
    if options.save_hf:  # WEIGHTS OUT: through a checkpoint, exported by rank 0
        save_run_as_hf(
            ckpt,
            lambda where: open_checkpointer(
                where,
                model,
                optimizer,
                global_batch_size=global_batch_size,
                plan_text=config.as_text(),
                fingerprint=started.fingerprint,
                **_sliced_by_hand(pm, config),
            ),
            options.steps,
            options.save_hf,
            started.hf_config,
            log=options.log,
        )
    if metrics is not None:
        metrics.close()
    if options.log:  # with --steps 0 too: what the startup alone left on each rank
        memory = results[-1].memory_bytes if results else memory_of(model, optimizer)
        print_rank_summary(
            results, mesh, prediction, started.report, first_step_s, memory, released
        )
    return results


def _accumulate(
    pm: ParallelModel,
    task: Task,
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    num_micro: int,
    device: torch.device,
    options: TrainOptions,
) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn (no pipeline); the mean loss."""
    mbs = targets.shape[0] // num_micro
    loss_sum = torch.zeros((), dtype=torch.float64)
    cp = pm.context_parallel
    for i in range(num_micro):
        mb = slice(i * mbs, (i + 1) * mbs)
        x, y = tuple(t[mb].to(device) for t in inputs), targets[mb].to(device)
        with loss_context(pm.tp_plan):  # loss_parallel() for a vocabulary-split head
            if cp is not None:  # this rank's sequence shard, at its global positions
                x, y, positions = cp.shard_batch(x, y)
                with _autocast(device, options.precision):
                    out = pm.model(*x, positions=positions)  # a stages.StageModule
                loss = cp.loss(out, y) / num_micro  # value: the micro-batch's global mean
            else:
                with _autocast(device, options.precision):
                    out = task.forward(pm.model, x)
                loss = task.loss(out, y)
                if i == 0:  # what a user's loss returned: a scalar backward can start from
                    check_loss(loss, f"the loss ({task.description})")
                loss = loss / num_micro
            # the outputs (the logits) are not needed by backward: freed before it, they are
            # not held beside the loss's fp32 copies at its peak (`CostOptions.logit_copies`)
            del out
            pm.data_parallel.before_backward(is_last_microbatch=i == num_micro - 1)
            loss.backward()
        loss_sum += local_shard(loss.detach()).double().cpu()
    return loss_sum


def _global_norm_and_loss(
    params: Iterable[nn.Parameter],
    loss: torch.Tensor,
    mesh: RuntimeMesh,
    world: int,
    fewer: dict[int, int] | None = None,
) -> tuple[float, float]:
    """One all-reduce over the world of [weighted squared gradient norm, loss / world]: every
    rank holds its data rank's mean loss (a pipeline broadcasts it to every stage). ``fewer``:
    id of a parameter held by world / n ranks rather than world -> n (`_held_fewer`): its
    share is n times larger."""
    pp = mesh.size("pp")
    fewer = fewer or {}
    # on the mesh's device: NCCL reduces CUDA tensors only, and the gradients are there
    total = torch.zeros(2, dtype=torch.float64, device=mesh.mesh.device_type)
    for p in params:
        if p.grad is not None:
            local = local_shard(p.grad).detach().double()
            share = _norm_share(p.grad, pp, world) * fewer.get(id(p), 1)
            total[0] += local.pow(2).sum() * share
    total[1] = loss / world
    dist.all_reduce(total)
    return math.sqrt(total[0].item()), total[1].item()


def _sliced_by_hand(pm: ParallelModel, config: ParallelConfig) -> dict[str, Any]:
    """What a checkpoint must tell apart (`autopar.runtime.checkpoint`): the parameters every
    rank names alike while holding its own slice -- a Hugging Face expert stack's under ep, an
    expert's width under etp -- each with its slice, and the layout they were sliced in."""
    sliced: dict[str, str] = {}
    layout = []
    ep = pm.expert_parallel
    if ep is not None and ep.stacked_names:
        sliced.update({name: f"@ep{ep.rank}of{ep.size}" for name in ep.stacked_names})
        layout.append(f"ep={ep.size}")
    if pm.split_experts:
        r = dist.get_rank(pm.mesh.group("tp"))
        for name in pm.split_experts:
            sliced[name] = sliced.get(name, "") + f"@tp{r}of{config.tp}"
        layout.append(f"etp={config.etp}")
    return {"sliced": sliced, "expert_layout": " ".join(layout), "hand_slices": pm.hand_slices}


def _reads_token_ids(model: nn.Module) -> bool:
    """Whether the first module holding parameters is an embedding: the model's first input
    is token ids (what `preflight.check_batch` asks of the data)."""
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            return isinstance(module, nn.Embedding)
    return False


def _held_fewer(pm: ParallelModel, config: ParallelConfig) -> dict[int, int]:
    """Parameter id -> how many times fewer ranks hold it than a replicated one: expert
    parallelism's experts ep (each ep rank its own), expert tensor parallelism's slices tp
    (plain tensors, each tp rank its own slice)."""
    out: dict[int, int] = {}
    ep = pm.expert_parallel.expert_names if pm.expert_parallel else frozenset()
    for name, p in pm.model.named_parameters():
        n = (config.ep if name in ep else 1) * (config.tp if name in pm.split_experts else 1)
        if n > 1:
            out[id(p)] = n
    return out


def _autocast(device: torch.device, precision: str) -> Any:
    if precision == "fp32":
        return contextlib.nullcontext()
    if ALIASES.get(precision, precision) in RUNTIME_PRECISIONS:  # bf16, and the recipes'
        # bf16 around their FP8 linears ("fp8" is an alias of fp8-tensorwise)
        return torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision must be one of {', '.join(RUNTIME_PRECISIONS)}, got {precision!r}")


def reference_run(
    task: Task, global_batch_size: int, options: TrainOptions | None = None
) -> list[StepResult]:
    """The single-process run the sharded ones must match: the whole global batch at once,
    plain torch, AdamW, `clip_grad_norm_`; the model made whole as `start_model` makes each
    shard (the same weights under the same seed or checkpoint)."""
    return reference_model(task, global_batch_size, options)[0]


def reference_model(
    task: Task, global_batch_size: int, options: TrainOptions | None = None
) -> tuple[list[StepResult], nn.Module]:
    """`reference_run`'s steps and the model they leave."""
    options = options or TrainOptions()
    model = build_whole(task, options.seed, weights=WeightsFrom(options.init_from))
    optimizer = _make_optimizer(model, options)
    results = []
    for step in range(options.steps):
        t0 = time.perf_counter()
        inputs, targets = task.batch(step, 0, global_batch_size)
        loss = task.loss(task.forward(model, inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), options.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = options.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        results.append(
            StepResult(
                step + 1,
                loss.item(),
                norm.item(),
                time.perf_counter() - t0,
                memory_of(model, optimizer),
            )
        )
    return results, model
