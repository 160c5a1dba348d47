"""Whether a model's code reshapes a tensor-parallel rank's share of a projection's output into
that rank's share of what it makes whole.

A column-parallel projection hands the model's code a rank's slice of its features. Code that
views the features into heads by "-1" heads (``view(b, L, -1, head_dim)``) gets the rank's
heads; code that views them by a fixed count gets something else that still runs and keeps the
model's output shapes:

- OPT's ``view(b, -1, heads, head_dim)`` on half the features folds the other half into the
  sequence axis: half the tokens, each attending over half the sequence;
- ModernBERT's ``view(b, L, 3, -1, head_dim)`` of its fused Wqkv, split as one block of
  features, makes q of half the q heads and k of the other half: its pieces must be split
  piece by piece (`fused_pieces`), which the view says, as a cut does for GPT-2's ``split``.

So the check follows each column-parallel output through the operations that keep its
elements in place -- elementwise ones, transposes, cuts, and reshapes -- noting which dimension
holds its (split) features, and records every reshape: in the whole run, each reshape's
shapes; in the run at tp = 2, the rank's. A reshape whose rank output is not the whole
output's with one dimension divided by tp -- the one where the features start, or for a fused
projection viewed as (pieces, heads, ...) the one after the pieces -- computes another model.
An operation that mixes the features with other values (a matmul, a reduction, attention)
ends the trail: what comes out is no longer the projection's features.

Public:
    ShareViews        a TorchFunctionMode helper: start(path, out, pieces), follow(...), reshapes
    view_pieces(reshapes, head) -> {path: (pieces, width)}   # fused ones a view shows
    misread(whole, split, ways) -> str              # the first reshape of a share misread, or ""
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from autopar.runtime.fused_pieces import CUTS

_MOVES = frozenset({"transpose", "swapaxes", "swapdims", "permute"})


class Reshape(NamedTuple):
    source: str  # the projection whose features the reshaped tensor holds
    op: str
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...]
    dim: int  # the dimension of ``shape_in`` holding the features
    pieces: int  # the projection's fused pieces still together in that dimension (1: none)


class ShareViews:
    """Follows column-parallel outputs (module docstring). `start` each output where it is made,
    `follow` each operation from a TorchFunctionMode's ``__torch_function__`` with its result;
    `reshapes` lists the reshapes of the followed tensors in call order."""

    def __init__(self) -> None:
        # id -> (the tensor, kept alive so its id is not reused; its source; dim; pieces)
        self.followed: dict[int, tuple[torch.Tensor, str, int, int]] = {}
        self.reshapes: list[Reshape] = []

    def start(self, path: str, out: Any, pieces: int = 1) -> None:
        if isinstance(out, torch.Tensor) and out.dim():
            self.followed[id(out)] = (out, path, out.dim() - 1, pieces)

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.followed:  # before the first projection: nothing to look for
            return
        leaves = tree_flatten((args, kwargs))[0]
        src = next(
            (a for a in leaves if isinstance(a, torch.Tensor) and id(a) in self.followed), None
        )
        if src is None or out is src:
            return
        _, path, dim, pieces = self.followed[id(src)]
        name = getattr(func, "__name__", "")
        if isinstance(out, torch.Tensor):
            moved = self._next_dim(name, args, kwargs, src, out, dim, path, pieces)
            if moved is not None:
                self.followed[id(out)] = (out, path, *moved)
        elif func in CUTS and isinstance(out, tuple | list):
            for t in out:
                if not isinstance(t, torch.Tensor):
                    continue
                if t.dim() == src.dim():  # cut along the features: each piece a piece alone
                    cut = t.shape[dim] != src.shape[dim]
                    self.followed[id(t)] = (t, path, dim, 1 if cut else pieces)
                elif t.dim() == src.dim() - 1:  # unbind of another dimension
                    along = _unbound_dim(args, kwargs, src)
                    if along != dim:
                        self.followed[id(t)] = (t, path, dim - (along < dim), pieces)

    def _next_dim(
        self, name: str, args: tuple, kwargs: dict, src: torch.Tensor, out: torch.Tensor,
        dim: int, path: str, pieces: int,
    ) -> tuple[int, int] | None:  # fmt: skip
        """(the features' dimension in ``out``, its pieces), or None: the trail ends."""
        if name in _MOVES:
            return _moved(name, args, kwargs, src.dim(), dim), pieces
        if out.shape == src.shape:  # elementwise, a copy, a cast
            return dim, pieces
        if out.numel() == src.numel():  # a reshape
            shape_in, shape_out = tuple(src.shape), tuple(out.shape)
            self.reshapes.append(Reshape(path, name, shape_in, shape_out, dim, pieces))
            return share_dim(shape_in, shape_out, dim, pieces)
        if out.dim() == src.dim() and out.shape[dim] == src.shape[dim]:  # sliced elsewhere
            return dim, pieces
        return None


def _moved(name: str, args: tuple, kwargs: dict, ndim: int, dim: int) -> int:
    given = list(args[1:]) or list(kwargs.values())
    if name == "permute":
        order = given[0] if len(given) == 1 and isinstance(given[0], list | tuple) else given
        return [d % ndim for d in order].index(dim)
    a, b = (d % ndim for d in given[:2])
    return b if dim == a else a if dim == b else dim


def _unbound_dim(args: tuple, kwargs: dict, src: torch.Tensor) -> int:
    along = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return along % src.dim()


def _suffix(shape: tuple[int, ...]) -> list[int]:
    """The elements each index of each dimension steps over, and 1 past the last."""
    out = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        out[i] = out[i + 1] * shape[i]
    return out


def _start_dim(shape_in: tuple, shape_out: tuple, dim: int) -> int | None:
    """The dimension of ``shape_out`` where ``shape_in``'s ``dim`` starts: the one of more than
    one index whose step over its indices spans what ``dim``'s does; None when ``dim``'s
    elements do not start at a dimension of ``shape_out`` (they would be cut apart)."""
    whole = _suffix(shape_in)[dim]
    steps = _suffix(shape_out)
    found = [k for k in range(len(shape_out)) if steps[k] == whole and shape_out[k] > 1]
    return found[0] if found else None


def share_dim(
    shape_in: tuple, shape_out: tuple, dim: int, pieces: int = 1
) -> tuple[int, int] | None:
    """(the dimension of ``shape_out`` holding a rank's share when ``dim`` of ``shape_in`` is
    split over ranks, the fused pieces still together there), or None when a share is not one
    block of any: where ``dim`` starts; for ``pieces`` fused pieces, ``dim`` itself unchanged,
    or, the pieces viewed as a dimension of their own, the next one inside ``dim``'s."""
    k = _start_dim(shape_in, shape_out, dim)
    if k is None or pieces == 1:
        return None if k is None else (k, 1)
    inner = _suffix(shape_in)[dim + 1]
    steps = _suffix(shape_out)
    if steps[k + 1] == inner:  # the same dimension, reshaped around
        return k, pieces
    if shape_out[k] != pieces:
        return None
    rest = [j for j in range(k + 1, len(shape_out)) if shape_out[j] > 1 and steps[j] > inner]
    return (rest[0], 1) if rest else None


def view_pieces(reshapes: list[Reshape], head: int) -> dict[str, tuple[int, int]]:
    """{projection: (its fused pieces, its width)} for each whose whole output is viewed as
    (pieces, heads, head width) in its features' place (ModernBERT's Wqkv: (3, heads,
    head_dim)): a view by a first count of more than one, then two or more dimensions ending
    in the head width."""
    out: dict[str, tuple[int, int]] = {}
    for r in reshapes:
        if not head or r.dim != len(r.shape_in) - 1 or r.pieces != 1:
            continue
        k = _start_dim(r.shape_in, r.shape_out, r.dim)
        group = r.shape_out[k:] if k is not None else ()
        if len(group) >= 3 and group[-1] == head and group[0] > 1:
            out.setdefault(r.source, (group[0], r.shape_in[-1]))
    return out


def misread(whole: list[Reshape], split: list[Reshape], ways: int) -> str:
    """Why the first reshape of a share in ``split`` (the run at tp = ``ways``) is not the rank's
    share of the same reshape in ``whole``, or "". The runs' reshapes pair in call order, up to
    the first where they part (another source or operation: the code took another path)."""
    for w, s in zip(whole, split, strict=False):
        if (w.source, w.op) != (s.source, s.op):
            return ""
        found = share_dim(w.shape_in, w.shape_out, w.dim, s.pieces)
        k, want = (found[0] if found else None), None
        if k is not None and w.shape_out[k] % ways == 0:
            want = (*w.shape_out[:k], w.shape_out[k] // ways, *w.shape_out[k + 1 :])
        if s.shape_out != want:
            share = list(want) if want else "not one block of it"
            return (
                f"its code reshapes {s.source}'s output ({s.op}) to {list(s.shape_out)} on a tp "
                f"rank, where that rank's share of the whole {list(w.shape_out)} is {share}: it "
                "reads the features by a fixed count, and would compute another model (a view "
                "by -1 heads of the heads' own width splits)"
            )
    return ""
