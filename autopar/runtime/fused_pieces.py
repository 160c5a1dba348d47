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

Public:
    Pieces.wrap(local, ways, width) -> Pieces     # the local output, ``width`` = one piece
    CUTS                                          # the functions that cut a tensor
"""

from __future__ import annotations

from typing import Any

import torch
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
            args, kwargs = _local_cut(func, source, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, Pieces) else t, out)


def _local_cut(func: Any, x: Pieces, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with its offsets along ``x``'s last dimension made local."""
    ways, last = x._ways, x.dim() - 1

    def local(offset: int) -> int:
        if offset % x._piece:
            raise ValueError(
                f"a fused projection's output (pieces of {x._piece} features, split over "
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
