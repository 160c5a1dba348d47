"""A fused projection's pieces under tensor parallelism: the rank's share of each, cut where the
model's code cuts the whole output.

GPT-2's `c_attn` makes q, k and v as one output of 3 x hidden features and its code cuts it with
``split(hidden)``; Phi-3's `qkv_proj` is cut by slices at offsets read from its config, its
`gate_up_proj` by ``chunk(2)``. Split over tp as one block of features, a rank would hold all of
q and half of k. Split piece by piece (each rank keeps its slice of every piece, DTensor's
`_StridedShard`), a rank holds [q_r | k_r | v_r] -- its heads of each -- but the code still cuts at
the whole width's offsets. `Pieces` is that local output: a tensor whose cuts along the last
dimension at the whole output's offsets are taken at the local ones (each offset / tp), so the
model's code runs unchanged. Every other operation sees a plain tensor.

An offset that does not fall on a piece boundary has no local counterpart: refused, with the
offset, where it is made (`autopar.runtime.split_check` checks a model's cuts on meta before a
plan uses them).

A piece-by-piece split is a `_StridedShard` on the "tp" mesh axis, which DCP cannot write
(it takes each rank's local tensor for one block of the whole): `unstrided` gives checkpoints
the plain split of the same dimension, `restrided` takes it back.

Public:
    Pieces.wrap(local, ways, piece) -> Pieces     # the local output, ``piece`` = one's width
    CUTS                                          # the functions that cut a tensor
    local_cut(func, args, kwargs, ways, piece) -> (args, kwargs)   # a cut's offsets, local
    unstrided(state) -> (state, {(part, key): original})   # for DCP's save and load
    restrided(loaded, original) -> DTensor        # a loaded value in the original's split
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # no public name (torch 2.13)
from torch.utils._pytree import tree_map

# the calls that cut a tensor into pieces (functions and methods)
CUTS = frozenset(
    {
        torch.split, torch.chunk, torch.tensor_split, torch.narrow, torch.unbind,
        torch.Tensor.split, torch.Tensor.chunk, torch.Tensor.tensor_split,
        torch.Tensor.narrow, torch.Tensor.unbind, torch.Tensor.__getitem__,
    }
)  # fmt: skip


class Pieces(torch.Tensor):
    """A column-parallel fused projection's local output (module docstring). Built by `wrap`;
    the result of any operation on it is a plain tensor."""

    _ways: int
    _piece: int  # one piece's whole width: every cut offset is a multiple of it

    @staticmethod
    def wrap(local: torch.Tensor, ways: int, piece: int) -> Pieces:
        out = local.as_subclass(Pieces)  # same data, still in autograd's graph
        out._ways, out._piece = ways, piece
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if func in CUTS and isinstance(source, Pieces):
            args, kwargs = local_cut(func, args, kwargs, source._ways, source._piece)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, Pieces) else t, out)


def local_cut(func: Any, args: tuple, kwargs: dict, ways: int, piece: int) -> tuple[tuple, dict]:
    """The arguments of ``func`` (a cut, `CUTS`) of ``args[0]``, a rank's share of pieces
    ``piece`` wide each split ``ways`` ways, with its offsets along the last dimension made
    local."""
    x = args[0]
    last = x.dim() - 1

    def local(offset: int) -> int:
        if offset % piece:
            raise ValueError(
                f"a fused projection's output (pieces of {piece} features, split over "
                f"{ways} tensor-parallel ranks piece by piece) is cut at {offset}, inside a "
                "piece: a rank holds no such offset"
            )
        return offset // ways

    name = getattr(func, "__name__", "")
    if name == "__getitem__":
        return (x, _local_index(args[1], last, local)), kwargs
    if name == "narrow":  # narrow(dim, start, length)
        given = dict(zip(("dim", "start", "length"), args[1:], strict=False)) | kwargs
        if given["dim"] % x.dim() != last:
            return args, kwargs
        return (x, given["dim"], local(given["start"]), local(given["length"])), {}
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if name in ("chunk", "unbind") or dim % x.dim() != last:
        return args, kwargs  # chunks of the whole are chunks of each piece's share
    sizes = kwargs.pop("split_size_or_sections", None) or kwargs.pop("indices_or_sections", None)
    sizes = args[1] if sizes is None else sizes
    if name == "tensor_split" and isinstance(sizes, int):  # a count of sections
        return args, kwargs
    cut = local(sizes) if isinstance(sizes, int) else [local(s) for s in sizes]
    return (x, cut, *args[2:]), kwargs


def _local_index(index: Any, last: int, local: Any) -> Any:
    """A __getitem__ index with a slice of the last dimension made local."""
    items = index if isinstance(index, tuple) else (index,)
    if not items or not isinstance(items[-1], slice):
        return index
    named = [i for i in items if i is not None and i is not Ellipsis]
    if Ellipsis not in items and len(named) != last + 1:
        return index  # the slice is not of the last dimension
    s = items[-1]
    if s.step not in (None, 1):
        raise ValueError("a fused projection's output is sliced with a step: unsupported")
    bounds = [
        None if b is None else (local(b) if b >= 0 else -local(-b)) for b in (s.start, s.stop)
    ]
    return (*items[:-1], slice(*bounds))


# ------------------------------------------------------------------ checkpoints


def unstrided(state: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict]:
    """``state`` with each DTensor split piece by piece over tp (a fused projection's,
    `_StridedShard` on the "tp" mesh axis, `autopar.runtime.fused_pieces`) as the plain split
    of the same dimension over tp alone, and {(part, key): the original}. DCP writes and reads
    each rank's local tensor as one block of the whole at one offset, which a rank's share of
    several pieces is not (saved as it is, the ranks' blocks overlap); and where FSDP2 shards
    the same dimension again, DTensor's own redistribution of the two strided splits is wrong
    (torch 2.13). So by steps: the FSDP shards joined into the tp rank's tensor, then that
    redistributed to the plain tp split; the copies on the other axes' ranks are the same
    blocks, which DCP writes once."""
    out: dict[str, dict[str, Any]] = {}
    strided: dict[tuple[str, str], DTensor] = {}
    for part, sd in state.items():
        out[part] = dict(sd)
        for key, value in sd.items():
            if (pieces := _tp_pieces(value)) is not None:
                tp_mesh = value.device_mesh["tp"]
                mine = DTensor.from_local(_tp_local(value), tp_mesh, [pieces], run_check=False)
                out[part][key] = mine.redistribute(tp_mesh, [Shard(pieces.dim)])
                strided[(part, key)] = value
    return out, strided


def _tp_pieces(value: Any) -> _StridedShard | None:
    """A DTensor's piece-by-piece split over the "tp" mesh axis, or None."""
    if not isinstance(value, DTensor):
        return None
    names = value.device_mesh.mesh_dim_names or ()
    found = [pl for pl, n in zip(value.placements, names, strict=False) if n == "tp"]
    return found[0] if found and isinstance(found[0], _StridedShard) else None


def _outer(value: DTensor) -> tuple[Any, list]:
    """The sub-mesh of ``value``'s axes other than "tp" and its plain splits there (FSDP2's
    strided shard of the tp rank's tensor as the Shard it is of that tensor); (None, []) when
    it is replicated on them."""
    names = value.device_mesh.mesh_dim_names
    outer = [(n, pl) for n, pl in zip(names, value.placements, strict=True) if n != "tp"]
    if all(pl.is_replicate() for _, pl in outer):
        return None, []
    mesh = value.device_mesh[tuple(n for n, _ in outer)]
    return mesh, [Shard(pl.dim) if isinstance(pl, _StridedShard) else pl for _, pl in outer]


def _tp_local(value: DTensor) -> torch.Tensor:
    """The tensor this rank's tp coordinate holds of ``value`` (its share of each piece),
    its shards on the other mesh axes (FSDP's, of the tp rank's tensor) joined."""
    mesh, plain = _outer(value)
    if mesh is None:
        return value.to_local()
    shape = list(value.shape)
    tp_index = value.device_mesh.mesh_dim_names.index("tp")
    shape[value.placements[tp_index].dim] //= value.device_mesh.size(tp_index)
    whole = torch.Size(shape)
    joined = DTensor.from_local(value.to_local(), mesh, plain, run_check=False, shape=whole,
                                stride=torch.empty(whole, device="meta").stride())  # fmt: skip
    return joined.full_tensor()


def restrided(loaded: DTensor, original: DTensor) -> DTensor:
    """A value `unstrided` gave DCP to fill, back in ``original``'s split."""
    pieces = _tp_pieces(original)
    assert pieces is not None
    mine = loaded.redistribute(loaded.device_mesh, [pieces]).to_local()
    mesh, plain = _outer(original)
    if mesh is not None:  # this rank's FSDP shard of the tp rank's tensor
        whole = DTensor.from_local(mine, mesh, [Replicate()] * len(plain), run_check=False)
        mine = whole.redistribute(mesh, plain).to_local()
    return DTensor.from_local(
        mine, original.device_mesh, original.placements, run_check=False,
        shape=original.shape, stride=original.stride(),
    )  # fmt: skip
