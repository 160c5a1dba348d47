"""Runtime overhead: what training through autopar's runtime costs beyond the op-level model.

The cost model prices each op (FLOPs, bytes, a launch overhead) and each collective (alpha-
beta); a real training step also spends host time on autograd bookkeeping, DTensor dispatch
and redistribution planning (tensor and sequence parallelism), FSDP2's hooks and its copy-in /
copy-out buffers. On a GPU most of that hides behind queued kernels; on CPU ranks it is the
step (local validation, 2026-11-21: TP2+SP measured 2.3x its op-level prediction).

In: the profiler's ranks (an initialised gloo or NCCL group of even size). Out: per parallel
style (`autopar.hardware.RUNTIME_STYLES`) the measured time of one micro-batch's forward and
backward through a small Llama layer stack (`MODEL`) at 1 and at 3 layers, and then -- given
the profile fitted from the same run's compute and collectives -- the overhead per layer:

    measured per layer  = (t(3 layers) - t(1 layer)) / 2       embedding, head, loss cancel
    predicted per layer = the same difference of `autopar.evaluate`'s forward + backward
                          (compute, TP and FSDP collectives; FSDP ZeRO-1/2's gather and
                          reduce-scatter, which this loop runs every micro-batch)
    overhead            = max(0, measured - predicted)
    model overhead      = max(0, t(1 layer) - its prediction - 1 x overhead)   per micro-batch,
                          outside the repeated layers (embedding, head, loss: vocabulary-
                          parallel logits under TP, FSDP2's root hooks)

Before that, plain is timed at a micro-batch of TRAINING_BATCH samples too: the time a layer's
micro-batch grows by from 1 to TRAINING_BATCH samples is work that scales with the batch, which
the op-level model should price. Its price over the measured growth is the profile's training
factor (`training_factor`): the compute curves' maxima take it (`document.render`), as the GPU
profiles' curves take an end-to-end training factor over their microbenchmarks, and the
overheads above are then measured against the scaled curves. Without it, what the batch-1
micro-batch's ops cost beyond their price would count as a fixed overhead per micro-batch and be
priced the same at every micro-batch size (local validation, 2026-11-30, on a 2-core Xeon
with a fresh profile: the configs at micro-batch 4-8 measured 10-37% slower than priced, those
at 1 within 5%; one process's small Llama grew by 26.8 ms per sample where the profile
priced 19.9 ms).

and the same for the optimizer step that follows (global gradient norm, clipping and AdamW
with foreach=False, as `autopar.runtime.trainer`): per layer per step against the cost
model's optimizer and grad_clip terms (a per-parameter loop: every op of it pays dispatch).

Each timed micro-batch starts after a barrier and the slowest rank's median counts (a step
goes at the pace of its slowest rank); the two depths alternate step by step, and the styles
take turns over ROUNDS rounds of 5 steps each (the median over all of a style's steps). The style's
config uses all the ranks: plain = dp, tp and tp_sp = tp 2 x dp, fsdp and fsdp3 = fsdp
(ZeRO-2, ZeRO-3), selective and full = dp with that recompute policy on every layer, split =
dp with the backward split as torch's pipelining splits it for the zero-bubble schedules
(config.SPLIT_BACKWARD): the blocks, head and loss run on the embedding's output detached
and made a leaf that requires grad -- what a later pipeline stage (the last, with the loss)
receives from the one before -- then `stage_backward_input` over that input and
`stage_backward_weight` over the parameters, as `PipelineStage.backward_one_chunk
(full_backward=False)` and `backward_weight_one_chunk` call them. The embedding's backward
is left out (a stage's input has none); it cancels in the per-layer difference. Split is
priced per repeated layer only (its own model and optimizer overheads would repeat plain's:
`LAYER_ONLY` styles are left out of those).

Public functions:
    measure_runtime(world_size, quick, progress) -> list[RuntimeMeasurement]   (every rank)
    training_factor(profile, measurements, world_size) -> float | None                    (rank 0)
    overheads(profile, measurements, world_size, part) -> {style: seconds}                (rank 0)
    model_overheads(profile, measurements, world_size) -> {style: seconds}                (rank 0)
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.config import ParallelConfig

if TYPE_CHECKING:
    from autopar.tracing import ModelGraph

Progress = Callable[[str], None]
MODEL = "llama-tiny"
# A small Llama layer (GQA), the size a few CPU cores train; 1 and 3 repeated layers.
MODEL_OVERRIDES = dict(
    vocab_size=2048, seq_len=128, hidden=256, ffn_hidden=688, num_heads=8, num_kv_heads=4
)  # fmt: skip
LAYERS = (1, 3)
# plain is also timed at this micro-batch: what a step's work grows by per sample, against the
# op-level price of the same growth (`training_factor`)
TRAINING_BATCH = 4
LAYER_ONLY = ("split",)  # styles with a per-layer micro-batch overhead only (module docstring)
ROUNDS = 3  # the styles take turns this many times (measure_runtime)


@dataclass(frozen=True)
class RuntimeMeasurement:
    style: str  # autopar.hardware.RUNTIME_STYLES
    num_layers: int
    time_s: float  # one micro-batch's forward + backward, slowest rank's median
    optimizer_s: float = 0.0  # the step's gradient clipping and AdamW step, the same way
    batch_size: int = 1  # samples per micro-batch (plain only: 1 and TRAINING_BATCH)


def style_config(style: str, world_size: int) -> ParallelConfig:
    """The config a style is measured under on ``world_size`` ranks (module docstring)."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"the runtime overheads need an even number of ranks, got {world_size}")
    if style == "plain":
        return ParallelConfig(dp=world_size)
    if style in ("tp", "tp_sp"):
        return ParallelConfig(dp=world_size // 2, tp=2, sequence_parallel=style == "tp_sp")
    if style in ("fsdp", "fsdp3"):
        return ParallelConfig(fsdp=world_size, zero_stage=3 if style == "fsdp3" else 2)
    if style in ("selective", "full"):
        return ParallelConfig(dp=world_size, recompute=style)
    if style == "split":  # plain tensors; the backward differs (module docstring)
        return ParallelConfig(dp=world_size)
    raise ValueError(f"unknown runtime style {style!r}")


def measure_runtime(
    world_size: int, *, quick: bool, progress: Progress
) -> list[RuntimeMeasurement]:
    """Time every style at 1 and 3 layers on this group's ranks (all ranks call this).

    The styles take turns over ROUNDS rounds (one in a quick run), each with fresh models, and
    a style's figure is the median over all its rounds' steps: a change in the machine's load
    (another process, a frequency step) falls on every style alike instead of on one."""
    from autopar.hardware.profile import RUNTIME_STYLES

    rounds, iterations = (1, 4) if quick else (ROUNDS, 5)
    runs = [(style, 1) for style in RUNTIME_STYLES] + [("plain", TRAINING_BATCH)]
    steps: dict[tuple[str, int], list[list[tuple[float, float]]]] = {
        run: [[] for _ in LAYERS] for run in runs
    }
    for r in range(rounds):
        for style, batch in runs:
            cfg = style_config(style, world_size)
            timed = _time_style(cfg, iterations, split=style == "split", batch_size=batch)
            for mine, got in zip(steps[(style, batch)], timed, strict=True):
                mine.extend(got)
        progress(f"runtime: round {r + 1}/{rounds} of {len(RUNTIME_STYLES)} styles")
    out = []
    for style, batch in runs:
        for layers, (seconds, optimizer_s) in zip(
            LAYERS, _slowest_medians(steps[(style, batch)]), strict=True
        ):
            out.append(RuntimeMeasurement(style, layers, seconds, optimizer_s, batch))
        per_layer = (out[-1].time_s - out[-2].time_s) / (LAYERS[1] - LAYERS[0])
        at = f" at micro-batch {batch}" if batch > 1 else ""
        progress(f"runtime {style}: {per_layer * 1e3:.2f} ms per layer per micro-batch{at}")
    return out


class _Runner:
    """One depth of the style's model on the plan's mesh, with its timed step parts."""

    def __init__(
        self, cfg: ParallelConfig, num_layers: int, *, split: bool = False, batch_size: int = 1
    ) -> None:
        from autopar.models import zoo
        from autopar.runtime.mesh import build_mesh
        from autopar.runtime.parallelize import parallelize_model
        from autopar.runtime.trainer import TrainOptions, _make_optimizer

        mesh = build_mesh(cfg, "cuda" if torch.cuda.is_available() else "cpu")
        cuda = mesh.mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        model = zoo.build(MODEL, num_layers=num_layers, **MODEL_OVERRIDES)
        self.pm = parallelize_model(model.to(self.device or "cpu"), mesh, cfg)
        self.loss_fn = zoo.loss_fn(MODEL)
        inputs, targets = zoo.example_batch(MODEL, model, batch_size=batch_size)
        self.inputs = tuple(t.to(self.device or "cpu") for t in inputs)
        self.targets = targets.to(self.device or "cpu")
        self.optimizer = _make_optimizer(self.pm.model, TrainOptions())
        self.split = split

    def _sync(self) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def micro_batch(self) -> float:
        from autopar.runtime.tp_apply import loss_context

        self.pm.model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if self.split:
            self._split_micro_batch()
            self._sync()
            return time.perf_counter() - start
        with loss_context(self.pm.tp_plan):
            loss = self.loss_fn(self.pm.model(*self.inputs), self.targets)
            self.pm.data_parallel.before_backward(is_last_microbatch=True)
            loss.backward()
        self._sync()
        return time.perf_counter() - start

    def _split_micro_batch(self) -> None:
        """Forward from the embedding's output as a stage input, then the backward in torch
        pipelining's two passes (module docstring)."""
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )

        from autopar.runtime.parts import default_positions, parts_of

        model = self.pm.model
        parts = parts_of(model)
        positions = default_positions(self.inputs)
        with torch.no_grad():
            h = parts.embed(model, self.inputs, positions)
        x = stage_input = h.detach().requires_grad_(True)
        ctx = parts.context(model, x, positions)
        for block in model.get_submodule(parts.blocks):
            x = parts.block(block, x, ctx)
        loss = self.loss_fn(parts.head(model, x), self.targets)
        _, groups = stage_backward_input([loss], None, [stage_input], model.parameters())
        stage_backward_weight(model.parameters(), groups)

    def optimizer_step(self) -> float:  # as the trainer: global norm, clip, AdamW
        from autopar.runtime.collectives import local_shard

        dist.barrier()
        start = time.perf_counter()
        grads = [p.grad for p in self.pm.model.parameters() if p.grad is not None]
        norm = torch.zeros((), dtype=torch.float64)
        for g in grads:
            norm += local_shard(g).detach().double().pow(2).sum()
        dist.all_reduce(norm)
        coef = min(1.0, 1.0 / (math.sqrt(norm.item()) + 1e-6))
        with torch.no_grad():
            for g in grads:
                local_shard(g).mul_(coef)
        self.optimizer.step()
        self._sync()
        return time.perf_counter() - start


def _time_style(
    cfg: ParallelConfig, iterations: int, *, split: bool = False, batch_size: int = 1
) -> list[list[tuple[float, float]]]:
    """Per depth of LAYERS: this rank's (micro-batch, optimizer step) times after two warm-up
    steps (``split``: the backward in two passes) of ``batch_size`` samples per micro-batch.
    The depths alternate step by step, so a change in the machine's load falls on both alike."""
    runners = [_Runner(cfg, layers, split=split, batch_size=batch_size) for layers in LAYERS]
    times: list[list[tuple[float, float]]] = [[] for _ in runners]
    for i in range(iterations + 2):  # two warm-up steps each
        for runner, mine in zip(runners, times, strict=True):
            step = (runner.micro_batch(), runner.optimizer_step())
            if i >= 2:
                mine.append(step)
    return times


def _slowest_medians(times: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Per depth, the (micro-batch, optimizer step) medians of the slowest rank: a step goes
    at the pace of its slowest rank (every rank calls this)."""
    medians = [
        (statistics.median(t for t, _ in mine), statistics.median(o for _, o in mine))
        for mine in times
    ]
    flat = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return [(float(a), float(b)) for a, b in flat]


def model_text() -> str:
    return ", ".join(f"{k} {v}" for k, v in MODEL_OVERRIDES.items())


def measured_per_layer(
    measurements: Sequence[RuntimeMeasurement], part: str = "time_s", batch_size: int = 1
) -> dict[str, float]:
    """Per style, the measured time per layer per micro-batch of ``batch_size`` (module
    docstring; the styles measured at it); ``part`` "optimizer_s": the optimizer step's."""
    measurements = [m for m in measurements if m.batch_size == batch_size]
    by_key = {(m.style, m.num_layers): getattr(m, part) for m in measurements}
    span = LAYERS[1] - LAYERS[0]
    return {
        style: (by_key[(style, LAYERS[1])] - by_key[(style, LAYERS[0])]) / span
        for style in dict.fromkeys(m.style for m in measurements)
    }


def overheads(
    profile, measurements: Sequence[RuntimeMeasurement], world_size: int, part: str = "time_s"
) -> dict[str, float]:
    """Per style, measured minus predicted time per layer per micro-batch, at least 0;
    ``part`` "optimizer_s": per layer per step of the optimizer step (not for `LAYER_ONLY`).

    ``profile``: a `HardwareProfile` fitted from the same run, without [runtime] overheads
    (its predictions are what the overheads add to)."""
    out = {}
    for style, measured in measured_per_layer(measurements, part).items():
        if part != "time_s" and style in LAYER_ONLY:
            continue
        out[style] = max(0.0, measured - predicted_per_layer(profile, style, world_size, part))
    return out


def training_factor(
    profile, measurements: Sequence[RuntimeMeasurement], world_size: int
) -> float | None:
    """The op-level price of what one plain layer's micro-batch grows by from 1 to
    TRAINING_BATCH samples over its measured growth: the factor the profile's compute curves
    take so that work per sample is priced as training runs it (module docstring). None
    without a measurement at TRAINING_BATCH or where either growth is not positive.
    ``profile`` as for `overheads`."""
    one = measured_per_layer(measurements).get("plain")
    big = measured_per_layer(measurements, batch_size=TRAINING_BATCH).get("plain")
    if one is None or big is None or big <= one:
        return None
    grown = predicted_per_layer(
        profile, "plain", world_size, batch_size=TRAINING_BATCH
    ) - predicted_per_layer(profile, "plain", world_size)
    return grown / (big - one) if grown > 0 else None


def model_overheads(
    profile,
    measurements: Sequence[RuntimeMeasurement],
    world_size: int,
    per_layer: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Per style, the host time per micro-batch outside the repeated layers (embedding, head,
    loss): the 1-layer time less its prediction and less one layer's overhead, at least 0
    (module docstring; not for `LAYER_ONLY` styles). ``profile`` as for `overheads`;
    ``per_layer``: `overheads`' result where the caller has it (else computed again)."""
    if per_layer is None:
        per_layer = overheads(profile, measurements, world_size)
    one = {
        m.style: m.time_s for m in measurements if m.num_layers == LAYERS[0] and m.batch_size == 1
    }
    return {
        style: max(
            0.0,
            one[style]
            - predicted_s(profile, style, LAYERS[0], world_size)
            - LAYERS[0] * per_layer[style],
        )
        for style in per_layer
        if style not in LAYER_ONLY
    }


def predicted_per_layer(
    profile, style: str, world_size: int, part: str = "time_s", batch_size: int = 1
) -> float:
    """`predicted_s` per repeated layer: its LAYERS[1]-layer less its LAYERS[0]-layer figure
    over the difference (embedding, head and loss cancel), as `measured_per_layer` measures."""
    deep, shallow = (
        predicted_s(profile, style, n, world_size, part, batch_size) for n in reversed(LAYERS)
    )
    return (deep - shallow) / (LAYERS[1] - LAYERS[0])


def predicted_s(
    profile,
    style: str,
    num_layers: int,
    world_size: int,
    part: str = "time_s",
    batch_size: int = 1,
) -> float:
    """The cost model's forward + backward of the measured micro-batch (module docstring) of
    ``batch_size``, or with ``part`` "optimizer_s" its gradient clipping and optimizer step."""
    from autopar.api import evaluate
    from autopar.hardware import Cluster

    cfg = replace(style_config(style, world_size), micro_batch_size=batch_size)
    model, graph = _traced(num_layers)
    cluster = Cluster(profile, 1, world_size)
    batch = batch_size * cfg.dp * cfg.fsdp
    plan = evaluate(model, cluster, cfg, graph=graph, global_batch_size=batch, precision="fp32")
    b = plan.breakdown
    if part == "optimizer_s":
        return b["optimizer"] + b["grad_clip"]
    keys = ["compute_forward", "compute_backward", "recompute", "tp_comm", "fsdp_comm"]
    if style in ("fsdp", "fsdp3"):
        keys.append("dp_comm")
    return sum(b[k] for k in keys)


@functools.cache
def _traced(num_layers: int) -> tuple[torch.nn.Module, ModelGraph]:
    """The measured model of ``num_layers`` on the meta device and its trace: traced once per
    depth, since every style and profile prices the same graph (a profile's fit prices each
    style at each depth, 100 traces before)."""
    from autopar.models import zoo
    from autopar.tracing import trace

    model = zoo.build(MODEL, device="meta", num_layers=num_layers, **MODEL_OVERRIDES)
    inputs, _ = zoo.example_batch(MODEL, model, batch_size=1)
    return model, trace(model, inputs)
