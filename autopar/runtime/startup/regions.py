"""Which elements of the whole model's tensor a rank's local tensor holds.

In: a parameter or buffer as the parallelised model holds it on this rank (a DTensor of TP,
FSDP2 or both; a plain tensor sliced by hand -- a Hugging Face expert stack's experts under
ep, an expert's width under etp -- or whole), its slices by hand, and the whole tensor's shape.
Out: a `Region`, one int64 index tensor per dimension: local[i, j, ...] = whole[rows[i],
cols[j], ...].

Slices compose in the order they were made: the hand slices first (expert parallelism, then
expert tensor parallelism, on the whole tensor), then the DTensor's placements, mesh dimension
by mesh dimension, on what the hand slices left (as `distribute_tensor` applies them) -- but
FSDP2 over tensor parallelism of the same dimension last: it chunks the tensor TP left
(`_cuts_by_dim`). Each
cut of a dimension's index list is torch's own: `Shard._split_tensor` (torch.chunk's sizes,
empty tails) and `_StridedShard._split_tensor` (FSDP over TP's right-to-left order), applied to
the index list instead of the data; a hand slice of `pieces` equal blocks, each cut over n
ranks, is a `_StridedShard` with split factor `pieces`.

Public functions:
    HandSlice(dim, pieces, rank, num)
    region_of(tensor, whole_shape, hand=()) -> Region
    Region.numel, Region.shape, Region.coords(start, stop) -> coordinates of a flat block
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard


@dataclass(frozen=True)
class HandSlice:
    """A slice a runtime module made by hand: along ``dim``, ``pieces`` equal blocks, each
    cut into ``num`` chunks, of which this rank keeps chunk ``rank`` of every block."""

    dim: int
    pieces: int
    rank: int
    num: int


@dataclass(frozen=True)
class Region:
    """Per dimension, the whole tensor's indices this rank holds, in local order."""

    indices: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(i) for i in self.indices)

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def is_whole(self, whole_shape: Sequence[int]) -> bool:
        return all(
            len(i) == s and bool((i == torch.arange(s)).all())
            for i, s in zip(self.indices, whole_shape, strict=True)
        )

    def coords(self, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The whole tensor's coordinates of local flat elements [start, stop) (row-major)."""
        flat = torch.arange(start, stop, device=device)
        out = []
        for index in reversed(self.indices):
            size = len(index)
            out.append(index.to(device)[flat % size])
            flat = torch.div(flat, size, rounding_mode="floor")
        return tuple(reversed(out))


def _cut(index: torch.Tensor, placement: Shard | _StridedShard, num: int, rank: int):
    one_dim = (
        _StridedShard(0, split_factor=placement.split_factor)
        if isinstance(placement, _StridedShard)
        else Shard(0)
    )
    shards, _ = one_dim._split_tensor(index, num, with_padding=False, contiguous=True)
    return shards[rank]


def _cuts_by_dim(placements: Sequence[Any]) -> dict[int, list[tuple[int, Any]]]:
    """Per tensor dimension, the (mesh dim, placement) cuts in the order the local tensor was
    made. In mesh order, except FSDP2 over a split of the same dimension: FSDP marks its cut
    `_StridedShard` (split factor: the later mesh dims' count) and makes it last -- a plain
    chunk of the tensor the later cuts left, which may itself be a piece-by-piece split (a
    fused projection's) that the strided mark does not describe."""
    by_dim: dict[int, list[tuple[int, Any]]] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            by_dim.setdefault(placement.dim, []).append((mesh_dim, placement))
    for d, cuts in by_dim.items():
        first_dim, first = cuts[0]
        if len(cuts) > 1 and isinstance(first, _StridedShard):
            by_dim[d] = [*cuts[1:], (first_dim, Shard(d))]
    return by_dim


def region_of(
    tensor: torch.Tensor, whole_shape: Sequence[int], hand: Sequence[HandSlice] = ()
) -> Region:
    """The `Region` of ``tensor`` (module docstring).

    Raises:
        ValueError: the slices leave another shape than the tensor's (a record of another
            model, or a slice this module was not told of).
    """
    indices = [torch.arange(s) for s in whole_shape]
    for cut in hand:
        placement = _StridedShard(cut.dim, split_factor=cut.pieces)
        indices[cut.dim] = _cut(indices[cut.dim], placement, cut.num, cut.rank)
    if isinstance(tensor, DTensor):
        mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
        for d, cuts in _cuts_by_dim(tensor.placements).items():
            for mesh_dim, placement in cuts:
                num = mesh.size(mesh_dim)
                indices[d] = _cut(indices[d], placement, num, coordinate[mesh_dim])
        local_shape = tuple(tensor.to_local().shape)
    else:
        local_shape = tuple(tensor.shape)
    region = Region(tuple(indices))
    if region.shape != local_shape:
        raise ValueError(
            f"a shard of a {tuple(whole_shape)} tensor holds {local_shape}, but its placements "
            f"and slices give {region.shape}"
        )
    return region
