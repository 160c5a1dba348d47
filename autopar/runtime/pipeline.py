"""Pipeline parallelism: this rank's model chunks driven by a torch.distributed.pipelining schedule.

In: a model, the plan's `ParallelConfig` (pp, schedule, virtual_stages), its stage boundaries
(`plan.stages[i].layers`, or an even split), the `RuntimeMesh`, the number of micro-batches
and the loss. A model `autopar.runtime.parts` knows is cut into `stages.StageModule`s; any
other whose blocks are one list, from its traced graph (`autopar.runtime.traced_stages`).
Out: a `Pipeline` whose `step(inputs, targets)` runs forward and backward of every
micro-batch on this rank's chunks and returns the mean loss on every pp rank.

    pipe = build_pipeline(model, mesh, config, num_microbatches=m, loss_fn=zoo.lm_loss,
                          stage_layers=[s.layers for s in plan.stages],
                          parallelize_chunk=lambda chunk: ...)   # TP / recompute / FSDP
    loss = pipe.step((ids,), targets)      # grads now in pipe.parameters()
    pipe.sync_tied_gradients()             # tied embedding: first + last stage (exact)
    ... data-parallel sync, clipping over pipe.norm_parameters(), optimizer step ...

Schedules (torch 2.13), `SCHEDULES[config.schedule]`:

    gpipe             ScheduleGPipe                   1 chunk per rank
    1f1b              Schedule1F1B                    1 chunk per rank, m >= pp
    interleaved_1f1b  ScheduleInterleaved1F1B         v >= 2 chunks per rank, loop placement,
                                                      m a multiple of max(1, m // pp)
    zero_bubble       ScheduleInterleavedZeroBubble   v >= 1 chunks, loop (ZB1P with v = 1),
                                                      m as interleaved
    zbv               ScheduleZBVZeroBubble           exactly 2 chunks, V placement
    dualpipe_v        ScheduleDualPipeV               exactly 2 chunks, V placement, m >= 2 pp

Gradient scale: the schedule's loss is `loss_fn(out, target) / m` and `scale_grads=False`, so
the gradients are those of the mean of the m micro-batch means -- the single-process
mean-loss gradient when micro-batches are equal -- as in the trainer's non-pipelined loop.
Data-parallel averaging is the caller's (`autopar.runtime.data_parallel`).

Public functions:
    SCHEDULES                                            # name -> ScheduleSpec
    check_schedule(schedule, pp, virtual_stages, num_microbatches)   # the clear errors
    pipeline_blocks(model) -> (blocks path, number of blocks)
    layout_for(config, model, stage_layers=None) -> ChunkLayout
    build_pipeline(model, mesh, config, *, num_microbatches, loss_fn, ...) -> Pipeline
    Pipeline.step(inputs, targets, positions=None) -> loss     # every pp rank
    Pipeline.sync_tied_gradients(), .parameters(), .norm_parameters(), .chunks, .as_text()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.config import ParallelConfig
from autopar.runtime.collectives import local_shard
from autopar.runtime.mesh import RuntimeMesh, collective_timeout
from autopar.runtime.parts import has_parts, parts_of, tied_parameters
from autopar.runtime.stages import (
    ChunkLayout,
    build_stage_modules,
    even_layout,
    layout_from_stages,
)
from autopar.runtime.traced_stages import Forward, require_blocks, traced_chunks

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ScheduleSpec:
    """A torch schedule class, by name, and what it requires (checked by `check_schedule`)."""

    name: str  # in torch.distributed.pipelining: `torch_class`
    style: str  # "loop" or "v": where chunk k runs (stages.ChunkLayout)
    min_chunks: int  # per rank
    max_chunks: int | None
    multi: bool  # takes a list of stages (PipelineScheduleMulti) rather than one
    microbatches: Callable[[int, int, int], str | None]  # (m, pp, v) -> a problem or None

    def torch_class(self) -> type:
        # imported here, not with this module: torch.distributed.pipelining imports
        # torch._dynamo (about 0.6 s of CPU), which a run without a pipeline never needs,
        # and every rank and CLI call imports this module
        import torch.distributed.pipelining as pipelining

        return getattr(pipelining, self.name)


def _any(m: int, pp: int, v: int) -> str | None:
    return None


def _at_least_pp(m: int, pp: int, v: int) -> str | None:
    return None if m >= pp else f"needs num_microbatches >= pp = {pp}, got {m}"


def _rounds(m: int, pp: int, v: int) -> str | None:
    rounds = max(1, m // pp)  # torch's flexible interleaving: m % rounds == 0
    if m % rounds:
        return (
            f"needs num_microbatches a multiple of max(1, m // pp) = {rounds}, got {m} "
            f"(pp={pp}); e.g. a multiple of pp"
        )
    return None


def _at_least_stages(m: int, pp: int, v: int) -> str | None:
    n = pp * v
    return None if m >= n else f"needs num_microbatches >= pp * 2 = {n}, got {m}"


SCHEDULES = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "loop", 1, 1, False, _any),
    "1f1b": ScheduleSpec("Schedule1F1B", "loop", 1, 1, False, _at_least_pp),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, None, True, _rounds),
    "zero_bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", "loop", 1, None, True, _rounds),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, 2, True, _any),
    "dualpipe_v": ScheduleSpec("ScheduleDualPipeV", "v", 2, 2, True, _at_least_stages),
}


def check_schedule(schedule: str, pp: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ValueError naming the numbers unless torch's ``schedule`` runs this shape."""
    spec = SCHEDULES.get(schedule)
    if spec is None:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    v, hi = virtual_stages, spec.max_chunks
    if v < spec.min_chunks or (hi is not None and v > hi):
        want = f"exactly {hi}" if hi == spec.min_chunks else f"at least {spec.min_chunks}"
        raise ValueError(
            f"schedule {schedule} ({spec.name}) needs {want} virtual stages (model "
            f"chunks) per pipeline rank, got virtual_stages={v}"
        )
    problem = spec.microbatches(num_microbatches, pp, v)
    if problem:
        raise ValueError(f"schedule {schedule} ({spec.name}) {problem}")


def layout_for(
    config: ParallelConfig,
    model: nn.Module,
    stage_layers: Sequence[Sequence[str]] | None = None,
    schedule: str | None = None,
) -> ChunkLayout:
    """The chunk layout of the plan: its stages' layer lists, or the even split without them;
    the placement (loop or V) is the schedule's (``schedule`` or config.schedule)."""
    blocks_path, n = pipeline_blocks(model)
    schedule = schedule or config.schedule
    style = SCHEDULES[schedule].style if schedule in SCHEDULES else "loop"
    if stage_layers is None or config.pipeline_slots:
        # with slots the plan's stages cannot show a chunk that holds no block: the even
        # split is the estimator's (`estimate.stages.split_chunks`), so rebuild it
        return even_layout(
            n,
            config.pp,
            config.virtual_stages,
            style,
            config.pipeline_slots,  # type: ignore[arg-type]
        )
    return layout_from_stages(
        stage_layers,
        blocks_path,
        n,
        config.pp,
        config.virtual_stages,
        style,  # type: ignore[arg-type]
    )


def pipeline_blocks(model: nn.Module) -> tuple[str, int]:
    """The path of the list of blocks the pipeline cuts between, and its length: the parts
    registry's for a model it knows, else the traced cut's (`traced_stages.traced_blocks`).

    Raises:
        ValueError: neither knows how to cut the model."""
    if has_parts(model):
        parts = parts_of(model)
        return parts.blocks, parts.num_blocks(model)
    return require_blocks(model)


class Pipeline:
    """This rank's chunks, their PipelineStages and the schedule (see the module docstring)."""

    def __init__(
        self,
        chunks: list[nn.Module],  # StageModule or traced_stages.TracedChunk
        layout: ChunkLayout,
        schedule: str,
        num_microbatches: int,
        loss_fn: LossFn,
        group: dist.ProcessGroup,
        device: torch.device,
        tie_group: dist.ProcessGroup | None = None,
        tied: tuple[tuple[str, str], ...] = (),
    ) -> None:
        check_schedule(schedule, layout.pp, layout.virtual_stages, num_microbatches)
        spec = SCHEDULES[schedule]
        if spec.style != layout.style:
            raise ValueError(f"schedule {schedule} places chunks {spec.style}, layout {layout}")
        self.chunks, self.layout, self.schedule_name = chunks, layout, schedule
        self.num_microbatches, self.group, self.tie_group = num_microbatches, group, tie_group
        self.tied = tied  # (head parameter path, embed parameter path)
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.microbatch import _Replicate

        self.stages = [
            PipelineStage(c, c.chunk, layout.num_chunks, device, group=group) for c in chunks
        ]
        m = num_microbatches

        def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(out, target) / m

        # positions are the same for every micro-batch: replicated, not split along the batch
        # (`_Replicate` is torch's own marker for that; the public TensorChunkSpec only splits)
        kwargs = dict(
            n_microbatches=m,
            loss_fn=scaled_loss,
            scale_grads=False,
            kwargs_chunk_spec={"positions": _Replicate()},
        )
        stages = self.stages if spec.multi else self.stages[0]
        self.schedule = spec.torch_class()(stages, **kwargs)
        self._loss_rank = layout.stage_of(layout.num_chunks - 1)  # pp rank of the last chunk

    @property
    def has_last_chunk(self) -> bool:
        return any(c.is_last for c in self.chunks)

    @property
    def has_first_chunk(self) -> bool:
        return any(c.is_first for c in self.chunks)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter this rank holds (tied copies included): the optimizer's."""
        for c in self.chunks:
            yield from c.parameters()

    def norm_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters the gradient norm counts: all but the tied copies (counted on the
        first stage)."""
        for c in self.chunks:
            for name, p in c.named_parameters():
                if name not in c.tied_copies:
                    yield p

    def step(
        self,
        inputs: tuple[torch.Tensor, ...],
        targets: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of this rank's batch, split into the micro-batches along dim 0.

        Every pp rank passes the same ``inputs`` and ``targets`` (only the first chunk reads
        the inputs, only the last the targets). ``positions``: the global positions of the
        sequence (context parallelism's shard), default `arange(S)`.

        Returns:
            the mean of the micro-batch losses (a 0-d fp32 tensor), on every pp rank.
        """
        losses: list[torch.Tensor] = []
        kwargs = {} if positions is None else {"positions": positions}
        args = inputs if self.has_first_chunk else ()
        target = targets if self.has_last_chunk else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        loss = torch.zeros((), dtype=torch.float32)
        if self.has_last_chunk:
            loss = torch.stack([local_shard(x).detach().float().cpu() for x in losses]).sum()
        device_loss = loss.to(self.stages[0].device)
        dist.broadcast(device_loss, group_src=self._loss_rank, group=self.group)
        return device_loss.cpu()

    def sync_tied_gradients(self) -> None:
        """Sum each tied weight's gradients over its first- and last-chunk copies (exact):
        locally when one rank holds both (a V), else all-reduced over the tie group."""
        first = next((c for c in self.chunks if c.is_first), None)
        last = next((c for c in self.chunks if c.is_last), None)
        for head, embed in self.tied:
            local = []
            if first is not None:
                local.append(_grad_of(first.get_parameter(embed)))
            if last is not None:
                local.append(_grad_of(last.get_parameter(head)))
            if not local:  # a middle stage
                continue
            total = local[0].clone() if len(local) == 1 else local[0] + local[1]
            if self.tie_group is not None:
                dist.all_reduce(total, group=self.tie_group)
            for g in local:
                g.copy_(total)

    def as_text(self) -> str:
        here = ", ".join(
            f"chunk {c.chunk} ({len(c.named_blocks())} blocks"
            + (", embed" if c.is_first else "")
            + (", head" if c.is_last else "")
            + ")"
            for c in self.chunks
        )
        return (
            f"pipeline {self.schedule_name} ({type(self.schedule).__name__}), "
            f"{self.num_microbatches} micro-batches; {self.layout.as_text()}; this rank: {here}"
        )


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    """The local gradient of ``p`` (zeros when backward left none)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local_shard(p.grad)


def tie_group_of(mesh: RuntimeMesh, layout: ChunkLayout) -> dist.ProcessGroup | None:
    """The group {first-chunk rank, last-chunk rank} of this rank's non-pp coordinates
    (Megatron's embedding group), or None when both chunks are on one pp rank. Every rank
    must call it (new_group is collective)."""
    first, last = layout.stage_of(0), layout.stage_of(layout.num_chunks - 1)
    if first == last:
        return None
    grid = mesh.mesh.mesh.reshape(mesh.size("pp"), -1)  # rank by (pp, rest)
    mine = None
    for col in range(grid.shape[1]):
        ranks = [int(grid[first, col]), int(grid[last, col])]
        group = dist.new_group(ranks, timeout=collective_timeout())  # the default group's
        if mesh.rank in ranks:
            mine = group
    return mine


def build_pipeline(
    model: nn.Module,
    mesh: RuntimeMesh,
    config: ParallelConfig,
    *,
    num_microbatches: int,
    loss_fn: LossFn,
    stage_layers: Sequence[Sequence[str]] | None = None,
    parallelize_chunk: Callable[[nn.Module], None] | None = None,
    device: torch.device | None = None,
    schedule: str | None = None,
    traced: tuple[Forward, tuple[torch.Tensor, ...]] | None = None,
) -> Pipeline:
    """Cut ``model`` at the plan's boundaries and build this rank's stages and schedule.

    Args:
        model: the full model, identical on every rank; consumed (its submodules move into
            the chunks; drop it afterwards).
        mesh: the plan's mesh; the "pp" axis carries the stages' send/recv.
        config: pp, schedule, virtual_stages.
        num_microbatches: micro-batches per step on this rank.
        loss_fn: (outputs, targets) -> mean loss of one micro-batch.
        stage_layers: `[s.layers for s in plan.stages]`; None: the even split.
        parallelize_chunk: applied to each chunk before its PipelineStage is made (TP,
            recompute, FSDP of the chunk's blocks: `StageModule.named_blocks()`).
        device: default: the mesh's device type.
        schedule: a `SCHEDULES` name overriding config.schedule (e.g. "zbv", which the
            planner does not price: ZBVZeroBubble on the V of DualPipeV).
        traced: (how the task calls the model, one micro-batch of its inputs), for a model
            `autopar.runtime.parts` does not know: its chunks are cut from its traced graph
            (`autopar.runtime.traced_stages`).

    Raises:
        ValueError: the schedule cannot run this shape (`check_schedule`), or the stage
            boundaries do not cut the model's blocks into pp * virtual_stages chunks.
    """
    schedule = schedule or config.schedule
    check_schedule(schedule, config.pp, config.virtual_stages, num_microbatches)
    layout = layout_for(config, model, stage_layers, schedule)
    chunks: list[nn.Module]
    if has_parts(model):
        parts = parts_of(model)
        tied = tied_parameters(model, parts)
        chunks = list(build_stage_modules(model, layout, mesh.pp_rank, parts))
    elif traced is None:
        raise ValueError(
            f"cutting {type(model).__name__} from its traced graph needs how the task calls it "
            "and one micro-batch of inputs (PipelineSpec.traced)"
        )
    else:
        device = device or torch.device(mesh.mesh.device_type)
        chunks, tied = traced_chunks(model, traced[0], traced[1], layout, mesh.pp_rank, device)
    for chunk in chunks:
        if parallelize_chunk is not None:
            parallelize_chunk(chunk)
    tie_group = tie_group_of(mesh, layout) if tied else None
    device = device or torch.device(mesh.mesh.device_type)
    return Pipeline(
        chunks,
        layout,
        schedule,
        num_microbatches,
        loss_fn,
        mesh.group("pp"),
        device,
        tie_group,
        tied,
    )
