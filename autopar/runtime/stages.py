"""Pipeline stage modules: a model + the plan's stage boundaries -> this rank's model chunks.

In: a model (with a `parts.ModelParts` entry), a `ChunkLayout` (which repeated blocks each
model chunk holds and which pipeline rank runs it) and this rank's pp index. Out: one
`StageModule` per chunk on this rank, in the order torch's schedules expect (ascending chunk
index).

Layout. The blocks are cut into `num_chunks = pp * virtual_stages` consecutive chunks (uneven
sizes allowed); the embedding rides on chunk 0 and the head on the last chunk. With pipeline
slots (`ParallelConfig.pipeline_slots`, Megatron's account_for_*_in_pipeline_split) the
embedding and the loss count as a block each in the even split, so chunk 0 may hold the
embedding alone and the last chunk the head alone. Chunk k runs on
    pp rank k mod pp                      "loop" (GPipe, 1F1B, interleaved 1F1B, zero-bubble)
    pp rank k, or 2*pp - 1 - k for k >= pp   "v"  (DualPipeV, ZBV): the V of DeepSeek-V3
as `autopar.estimate.step` places them, so a plan's `stages[i].layers` read back to the same
chunks (`layout_from_stages`). On a V, chunks pp-1 and pp share a rank and are adjacent, so
the plan's layer lists do not say where one ends: that run is split in half (the estimator's
even split does the same; its balanced split may differ by a block).

Names. A `StageModule` holds the model's own submodules under their original paths (the
blocks in an `nn.ModuleDict` keyed by the original index, at the ModuleList's path), so every
parameter keeps its fully qualified name: a `torch.distributed.checkpoint` written under one
plan loads under another.

Tied embeddings (GPT-2's head shares `tok_emb.weight`): the last chunk holds its own copy of
the tied weight under the head's name (`lm_head.weight`); after backward the two gradients are
summed (`autopar.runtime.pipeline.Pipeline.sync_tied_gradients`, Megatron's embedding group),
so both copies take the same optimizer step and stay equal. The copy is left out of the
gradient norm (`StageModule.tied_copies`).

Public functions:
    ChunkLayout(pp, bounds, style)            .stage_of(k), .chunks_on(pp_rank), .as_text()
    even_layout(num_blocks, pp, virtual_stages=1, style="loop", slots=()) -> ChunkLayout
    layout_from_sizes(sizes, pp, style="loop") -> ChunkLayout
    layout_from_stages(stage_layers, blocks_path, num_blocks, pp, virtual_stages, style)
    build_stage_modules(model, layout, pp_rank, parts=None) -> list[StageModule]
    StageModule.named_blocks() -> [(path, block)]   # for TP / recompute / FSDP per block
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from autopar.estimate.stages import even_sizes
from autopar.runtime.parts import ModelParts, default_positions, parts_of, tied_parameters

Style = Literal["loop", "v"]


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk k holds blocks [bounds[k][0], bounds[k][1]) and runs on pp rank `stage_of(k)`."""

    pp: int
    bounds: tuple[tuple[int, int], ...]
    style: Style = "loop"

    def __post_init__(self) -> None:
        n = len(self.bounds)
        if self.style not in ("loop", "v"):
            raise ValueError(f"ChunkLayout: style must be loop or v, got {self.style!r}")
        if n % self.pp:
            raise ValueError(f"ChunkLayout: {n} chunks do not divide over pp={self.pp} ranks")
        if self.style == "v" and n != 2 * self.pp:
            raise ValueError(f"ChunkLayout: a V needs 2 * pp = {2 * self.pp} chunks, got {n}")
        stop = 0
        for k, (a, b) in enumerate(self.bounds):
            # the first and last chunk may hold only the embedding or the head (pipeline slots)
            empty_ok = n > 1 and k in (0, n - 1)
            if a != stop or b < a or (b == a and not empty_ok):
                raise ValueError(
                    f"ChunkLayout: chunk {k} holds blocks [{a}, {b}), expected a non-empty "
                    f"range starting at block {stop} (chunks must be consecutive; only the "
                    "first and the last may be empty)"
                )
            stop = b
        if self.num_blocks == 0:
            raise ValueError("ChunkLayout: the chunks hold no block")

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    @property
    def num_blocks(self) -> int:
        return self.bounds[-1][1]

    @property
    def virtual_stages(self) -> int:
        return self.num_chunks // self.pp

    def stage_of(self, chunk: int) -> int:
        """The pp rank that runs ``chunk``."""
        if self.style == "v":
            return chunk if chunk < self.pp else 2 * self.pp - 1 - chunk
        return chunk % self.pp

    def chunks_on(self, pp_rank: int) -> tuple[int, ...]:
        """The chunks ``pp_rank`` runs, ascending."""
        return tuple(k for k in range(self.num_chunks) if self.stage_of(k) == pp_rank)

    def as_text(self) -> str:
        parts = [
            f"chunk {k} {f'blocks {a}-{b - 1}' if b > a else 'no block'} on pp {self.stage_of(k)}"
            for k, (a, b) in enumerate(self.bounds)
        ]
        return f"pipeline ({self.style}, pp={self.pp}): " + "; ".join(parts)


def layout_from_sizes(sizes: Sequence[int], pp: int, style: Style = "loop") -> ChunkLayout:
    """Chunks of ``sizes`` blocks each, in model order (``[1, 3]``: an uneven PP2)."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return ChunkLayout(pp, tuple(bounds), style)


def even_layout(
    num_blocks: int,
    pp: int,
    virtual_stages: int = 1,
    style: Style = "loop",
    slots: Sequence[str] = (),
) -> ChunkLayout:
    """Megatron's even split (the extra blocks to the middle chunks), as the estimator's
    (`autopar.estimate.stages.split_chunks`); ``slots`` (`ParallelConfig.pipeline_slots`)
    count the embedding and/or the loss as a block each in the split."""
    n = pp * virtual_stages
    if num_blocks + len(slots) < n:
        raise ValueError(
            f"pp={pp} x virtual_stages={virtual_stages} = {n} chunks but the model has "
            f"{num_blocks} blocks" + (f" (+ {len(slots)} slots)" if slots else "")
        )
    return layout_from_sizes(even_sizes(num_blocks, n, slots), pp, style)


def layout_from_stages(
    stage_layers: Sequence[Sequence[str]],
    blocks_path: str,
    num_blocks: int,
    pp: int,
    virtual_stages: int = 1,
    style: Style = "loop",
) -> ChunkLayout:
    """The chunks a plan's `stages[i].layers` describe (see the module docstring).

    Layers that are not blocks (embedding, head, the traced prologue) are ignored: they go to
    the first and last chunks by definition.

    Raises:
        ValueError: a block is missing, placed twice, or the runs do not make
            pp * virtual_stages chunks on the ranks the style expects.
    """
    if len(stage_layers) != pp:
        raise ValueError(f"the plan lists {len(stage_layers)} stages, the config pp={pp}")
    pattern = re.compile(rf"^{re.escape(blocks_path)}\.(\d+)(\.|$)")
    owner: dict[int, int] = {}
    for stage, layers in enumerate(stage_layers):
        for name in layers:
            match = pattern.match(name)
            if match is None:
                continue
            i = int(match.group(1))
            if owner.setdefault(i, stage) != stage:
                raise ValueError(f"block {name} is on stages {owner[i]} and {stage}")
    missing = sorted(set(range(num_blocks)) - set(owner))
    if missing or len(owner) != num_blocks:
        raise ValueError(
            f"the plan's stages place {len(owner)} of {num_blocks} blocks "
            f"({blocks_path}.*); missing: {missing[:8]}"
        )
    runs: list[list[int]] = []  # [stage, start, stop]
    for i in range(num_blocks):
        if runs and runs[-1][0] == owner[i]:
            runs[-1][2] = i + 1
        else:
            runs.append([owner[i], i, i + 1])
    n = pp * virtual_stages
    if style == "v" and len(runs) == n - 1:  # chunks pp-1 and pp are one run on rank pp-1
        stage, a, b = runs[pp - 1]
        if b - a < 2:
            raise ValueError(f"the V's turn on stage {stage} holds {b - a} block, needs >= 2")
        half = a + (b - a) // 2
        runs[pp - 1 : pp] = [[stage, a, half], [stage, half, b]]
    layout = ChunkLayout(pp, tuple((a, b) for _, a, b in runs), style) if len(runs) == n else None
    if layout is None or any(layout.stage_of(k) != s for k, (s, _, _) in enumerate(runs)):
        got = ", ".join(f"blocks {a}-{b - 1} on stage {s}" for s, a, b in runs)
        raise ValueError(
            f"the plan's stages do not form pp={pp} x virtual_stages={virtual_stages} "
            f"chunks placed {style}: {got}"
        )
    return layout


class StageModule(nn.Module):
    """One model chunk: its blocks, the embedding on the first, the head on the last.

    `forward(*inputs, positions=None)`: the first chunk takes the model's inputs (token ids),
    the others the hidden states; `positions` (global positions of the sequence, default
    `arange(S)`) rebuilds the per-stage context (RoPE tables, mask) on every chunk.
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        layout: ChunkLayout,
        chunk: int,
    ) -> None:
        super().__init__()
        self.chunk = chunk
        self.num_chunks = layout.num_chunks
        self.is_first = chunk == 0
        self.is_last = chunk == layout.num_chunks - 1
        self.parts = parts
        self.blocks_path = parts.blocks
        tied = dict(tied_parameters(model, parts)) if self.is_last and not self.is_first else {}
        # head parameter path -> embed parameter path, for the copies this chunk holds
        self.tied_copies: dict[str, str] = tied
        paths = list(parts.shared_modules)
        paths += list(parts.embed_modules) if self.is_first else []
        paths += list(parts.head_modules) if self.is_last else []
        for path in paths:
            module = model.get_submodule(path)
            if any(t.startswith(path + ".") for t in tied):
                module = copy.deepcopy(module)  # its own copy of the tied weight
            _attach(self, path, module)
        all_blocks = model.get_submodule(parts.blocks)
        a, b = layout.bounds[chunk]
        _attach(self, parts.blocks, nn.ModuleDict({str(i): all_blocks[i] for i in range(a, b)}))

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        """(original path, block) of this chunk's blocks, e.g. ("blocks.2", GPTBlock)."""
        held = self.get_submodule(self.blocks_path)
        return [(f"{self.blocks_path}.{k}", m) for k, m in held.items()]

    def forward(self, *args: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        positions = default_positions(args) if positions is None else positions
        p = self.parts
        h = p.embed(self, args, positions) if self.is_first else args[0]
        ctx = p.context(self, h, positions)
        for block in self.get_submodule(self.blocks_path).values():
            h = p.block(block, h, ctx)
        return p.head(self, h) if self.is_last else h


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating plain containers."""
    *outer, leaf = path.split(".")
    here = root
    for name in outer:
        if name not in here._modules:
            here.add_module(name, nn.Module())
        here = here._modules[name]
    here.add_module(leaf, module)


def build_stage_modules(
    model: nn.Module, layout: ChunkLayout, pp_rank: int, parts: ModelParts | None = None
) -> list[StageModule]:
    """This pp rank's chunks of ``model``, ascending (see the module docstring).

    The chunks share the model's submodules (no copy, except a tied head weight); the model
    itself should be dropped afterwards so the other ranks' blocks are freed.

    Raises:
        ValueError: the layout's blocks differ from the model's, or pp_rank is out of range.
    """
    parts = parts or parts_of(model)
    num_blocks = parts.num_blocks(model)
    if layout.num_blocks != num_blocks:
        raise ValueError(f"the layout cuts {layout.num_blocks} blocks, the model has {num_blocks}")
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is not in 0..{layout.pp - 1}")
    return [StageModule(model, parts, layout, k) for k in layout.chunks_on(pp_rank)]
