"""Replaying a recorded build at chosen elements: the values of a tensor's shard, only.

In: an `InitRecord` source (`record.Ref` or `record.Const`) and coordinates -- a tuple of
int64 index tensors, one per dimension, each of N entries. Out: the N values the source holds
at those coordinates, as the whole build would have made them.

A `Ref`'s element at coordinates c lies at storage position p = offset + sum_d c_d * stride_d.
Its value there is the storage's creator at p, then each write up to the Ref's version whose
view covers p, in order:

    factory      zeros / ones / full / arange / empty (as zeros) at p; rand / randn: the
                 counter-based draw at p (`rng`)
    pointwise    op(arguments at the same coordinates, broadcast) -- `mul`, `_to_copy`, ...
    uniform_ / normal_    the draw at p with the write's key, scaled
    fill_ / zero_ / copy_ the value, or the source at the view's coordinates
    pointwise in place    op_(old value, arguments at the view's coordinates)
    anything else         the whole tensor, made once (`_full_storage`, cached per tensor),
                          then read at p: correct for any op, at the memory of that tensor

Writes before the last one that overwrites the whole storage without reading it (a linear's
`kaiming_uniform_` under transformers' `normal_`) are skipped. Every rule reads each element's
own inputs only, so a rank computing its shard gets the values the whole tensor holds there,
whatever the shard; the whole-tensor fallback computes those same values for every position.

Public functions:
    Evaluator(device="cpu").values(source, coords) -> tensor of N values
    Evaluator.full(source) -> the whole tensor
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autopar.runtime.startup import rng
from autopar.runtime.startup.record import (
    RANDOM,
    Const,
    Layout,
    Node,
    Ref,
    Source,
    Storage,
    Write,
    op_name,
)

_ZERO_FACTORIES = frozenset(
    {"zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty", "empty_strided",
     "new_empty_strided", "empty_permuted"}
)  # fmt: skip
_ONE_FACTORIES = frozenset({"ones", "ones_like", "new_ones"})
_FULL_FACTORIES = frozenset({"full", "full_like", "new_full"})
_COPIES = frozenset({"_to_copy", "clone", "lift_fresh_copy", "copy", "contiguous", "alias_copy"})
# writes that overwrite what they cover without reading it
_OVERWRITES = frozenset({"zero_", "fill_", "uniform_", "normal_", "copy_"})
# random writes with a counter rule here; other random ops run whole on a seeded generator
_COUNTER_WRITES = frozenset({"uniform_", "normal_"})
Coords = tuple[torch.Tensor, ...]


def _is_pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in func.tags


def _nested_dims(layout: Layout) -> list[int] | None:
    """The dimensions of size > 1 by stride, smallest first, when each stride exceeds all the
    smaller ones reach (the view's elements do not overlap); None otherwise."""
    dims = sorted((d for d, s in enumerate(layout.size) if s > 1), key=lambda d: layout.stride[d])
    span = 0
    for d in dims:
        if layout.stride[d] <= span:
            return None
        span += (layout.size[d] - 1) * layout.stride[d]
    return dims


def decompose(positions: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, Coords] | None:
    """(mask, coordinates): which storage ``positions`` the view ``layout`` covers, and at
    which coordinates of the view; None for a view whose elements overlap (a stride-0
    expansion), which the caller evaluates whole."""
    dims = _nested_dims(layout)
    if dims is None:
        return None
    rel = positions - layout.offset
    mask = rel >= 0
    coords: list[torch.Tensor] = [torch.zeros_like(positions)] * len(layout.size)
    for d in reversed(dims):
        c = torch.div(rel, layout.stride[d], rounding_mode="floor")
        coords[d] = c
        rel = rel - c * layout.stride[d]
        mask &= (c >= 0) & (c < layout.size[d])
    mask &= rel == 0
    return mask, tuple(coords)


def positions_of(layout: Layout, coords: Coords) -> torch.Tensor:
    """The storage positions of ``coords`` in the view ``layout``."""
    pos = torch.full_like(coords[0], layout.offset)
    for c, s in zip(coords, layout.stride, strict=True):
        pos = pos + c * s
    return pos


def broadcast(coords: Coords, from_size: tuple[int, ...], to_size: tuple[int, ...]) -> Coords:
    """The coordinates in a tensor of ``to_size`` that broadcasting reads for ``coords`` of
    a tensor of ``from_size`` (aligned right; a size-1 dimension reads index 0)."""
    lead = len(from_size) - len(to_size)
    return tuple(
        coords[lead + d] if size != 1 else torch.zeros_like(coords[lead + d])
        for d, size in enumerate(to_size)
    )


def _size_of(source: Source) -> tuple[int, ...]:
    return tuple(source.tensor.shape) if isinstance(source, Const) else source.layout.size


class Evaluator:
    """Evaluates record sources at coordinates on ``device`` (module docstring); whole tensors
    the fallback makes are cached until `clear`."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def clear(self) -> None:
        self._cache.clear()

    # -- sources ---------------------------------------------------------------------------

    def values(self, source: Source, coords: Coords) -> torch.Tensor:
        """``source`` at ``coords`` (one int64 tensor per dimension); a 0-dim tensor for a
        0-dim source."""
        if isinstance(source, Const):
            t = source.tensor.to(self.device)
            return t[coords] if coords else t.reshape(())
        if not coords:
            pos = torch.full((1,), source.layout.offset, device=self.device)
            return self._storage_values(source.storage, pos, source.version).reshape(())
        pos = positions_of(source.layout, coords)
        return self._storage_values(source.storage, pos, source.version)

    def full(self, source: Source) -> torch.Tensor:
        """The whole tensor ``source`` stands for."""
        if isinstance(source, Const):
            return source.tensor.to(self.device)
        data = self._full_storage(source.storage, source.version)
        lay = source.layout
        return data.as_strided(lay.size, lay.stride, lay.offset)

    def _full_storage(self, storage: Storage, version: int) -> torch.Tensor:
        key = (storage.index, version)
        if key not in self._cache:
            if version > 0 and not _local(storage.writes[version - 1]):
                data = self._full_storage(storage, version - 1).clone()
                self._run_write(storage.writes[version - 1], data)
            else:
                pos = torch.arange(storage.numel, device=self.device)
                data = self._storage_values(storage, pos, version)
            self._cache[key] = data
        return self._cache[key]

    # -- storages --------------------------------------------------------------------------

    def _storage_values(self, storage: Storage, pos: torch.Tensor, version: int) -> torch.Tensor:
        writes = storage.writes[:version]
        start = _last_overwrite(storage, writes)
        if start < 0:
            vals = self._creator_values(storage, pos)
        else:
            vals = torch.zeros(pos.shape, dtype=storage.dtype, device=self.device)
        for i in range(max(start, 0), len(writes)):
            if not _local(writes[i]):
                vals = self._full_storage(storage, i + 1)[pos]
                continue
            vals = self._apply(storage, writes[i], pos, vals)
        return vals

    def _creator_values(self, storage: Storage, pos: torch.Tensor) -> torch.Tensor:
        found = decompose(pos, storage.layout)
        if found is None:
            raise RuntimeError(f"storage {storage.index}: its creator's output overlaps")
        mask, coords = found
        vals = self._node_values(storage.creator, storage.layout, coords, storage.dtype)
        if not bool(mask.all()):  # a storage larger than its creator's output: zeros outside
            vals = torch.where(mask, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
        return vals

    def _apply(
        self, storage: Storage, write: Write, pos: torch.Tensor, vals: torch.Tensor
    ) -> torch.Tensor:
        if _whole(write.target, storage.numel) and not _reads_tensors(write):
            # every position is in the view, and the rule reads no coordinates (the usual
            # init: normal_ or fill_ over a whole parameter): no index tensors made
            return self._written(write, pos, (), vals).to(vals.dtype).contiguous()
        mask, coords = decompose(pos, write.target)  # type: ignore[misc]  (_local checked)
        if not bool(mask.any()):
            return vals
        if bool(mask.all()):
            return self._written(write, pos, coords, vals).to(vals.dtype).contiguous()
        sel = tuple(c[mask] for c in coords)
        vals = vals.clone()
        vals[mask] = self._written(write, pos[mask], sel, vals[mask]).to(vals.dtype)
        return vals

    def _written(self, write: Write, pos: torch.Tensor, coords: Coords, old: torch.Tensor):
        """The values ``write`` leaves at storage positions ``pos`` (its view's ``coords``),
        where ``old`` were."""
        name, dtype = op_name(write.func), old.dtype
        if name == "zero_":
            return torch.zeros_like(old)
        if name == "fill_":
            value = write.args[1]
            if isinstance(value, Ref | Const):
                value = self.values(value, ())
            return torch.as_tensor(value, device=self.device).to(dtype).expand(old.shape)
        if name == "uniform_":
            low, high = _arg(write, 1, "from", 0.0), _arg(write, 2, "to", 1.0)
            return (low + (high - low) * rng.uniform(write.key, pos)).to(dtype)
        if name == "normal_":
            mean, std = _arg(write, 1, "mean", 0.0), _arg(write, 2, "std", 1.0)
            return (mean + std * rng.normal(write.key, pos)).to(dtype)
        if name == "copy_":
            src = write.args[1]
            src_size = _size_of(src)
            src_coords = broadcast(coords, write.target.size, src_size) if src_size else ()
            return self.values(src, src_coords).to(dtype).expand(old.shape)
        # a pointwise op in place: on the old values, its tensor arguments read alike
        tmp = old.clone()
        rest = self._at(write.args[1:], coords, write.target.size)
        write.func(tmp, *rest, **self._at(write.kwargs, coords, write.target.size))
        return tmp

    def _run_write(self, write: Write, data: torch.Tensor) -> None:
        """Run ``write`` on ``data``, the whole storage (the fallback)."""
        lay = write.target
        view = data.as_strided(lay.size, lay.stride, lay.offset)
        args, kwargs = self._real(write.args, write.kwargs, write.key)
        if isinstance(write.arg, int):
            args = (*args[: write.arg], view, *args[write.arg + 1 :])
        else:
            kwargs[write.arg] = view
        write.func(*args, **kwargs)

    def _real(self, args: tuple, kwargs: dict, key: int | None) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with every source made whole, on this device; a random op
        gets a generator seeded by its key."""

        def real(x: Any) -> Any:
            return self.full(x) if isinstance(x, Ref | Const) else x

        args, kwargs = tree_map(real, (tuple(args), dict(kwargs)))
        if "device" in kwargs:
            kwargs["device"] = self.device
        if key is not None:
            kwargs["generator"] = torch.Generator(self.device).manual_seed(key & (2**63 - 1))
        return args, kwargs

    def _at(self, tree: Any, coords: Coords, size: tuple[int, ...]) -> Any:
        """``tree`` with each source replaced by its values at ``coords`` of a tensor of
        ``size`` (broadcast; a 0-dim source stays 0-dim)."""

        def one(x: Any) -> Any:
            if not isinstance(x, Ref | Const):
                return x
            src_size = _size_of(x)
            return self.values(x, broadcast(coords, size, src_size) if src_size else ())

        return tree_map(one, tree)

    # -- creators --------------------------------------------------------------------------

    def _node_values(
        self, node: Node, layout: Layout, coords: Coords, dtype: torch.dtype
    ) -> torch.Tensor:
        name = op_name(node.func)
        n = coords[0].shape[0] if coords else 1
        if name in _ZERO_FACTORIES:
            return torch.zeros(n, dtype=dtype, device=self.device)
        if name in _ONE_FACTORIES:
            return torch.ones(n, dtype=dtype, device=self.device)
        if name in _FULL_FACTORIES or name == "scalar_tensor":
            value = {"full": -1, "full_like": 1, "new_full": 2, "scalar_tensor": 0}[name]
            return torch.full((n,), node.args[value], dtype=dtype, device=self.device)
        if name == "arange":
            start, step = _arange_start_step(node)
            return (start + coords[0] * step).to(dtype)
        if name in ("randn", "rand") and node.output == 0:
            draw = rng.normal if name == "randn" else rng.uniform
            return draw(node.key, _flat_index(layout.size, coords)).to(dtype)
        if name not in RANDOM and (_is_pointwise(node.func) or name in _COPIES):
            args = self._at(node.args, coords, layout.size)
            drop = ("device", "layout", "pin_memory", "memory_format", "non_blocking")
            kwargs = {k: v for k, v in node.kwargs.items() if k not in drop}
            out = node.func(*args, **kwargs).to(self.device)
            return out.expand(n) if out.dim() == 0 else out
        args, kwargs = self._real(node.args, node.kwargs, node.key)
        whole = tree_leaves(node.func(*args, **kwargs))[node.output]
        return whole[coords] if coords else whole.reshape(1)


def _local(write: Write) -> bool:
    """Whether ``write`` has an element-wise rule here (`Evaluator._written`)."""
    name = op_name(write.func)
    if write.arg != 0 or decompose(torch.zeros(0, dtype=torch.int64), write.target) is None:
        return False
    if name in ("zero_", "fill_", "copy_") or name in _COUNTER_WRITES:
        return True
    return name not in RANDOM and name.endswith("_") and _is_pointwise(write.func)


def _whole(target: Layout, numel: int) -> bool:
    """Whether the view ``target`` covers every element of a storage of ``numel``."""
    return target.offset == 0 and target.numel == numel and _nested_dims(target) is not None


def _reads_tensors(write: Write) -> bool:
    """Whether ``write``'s rule reads a tensor at the view's coordinates (a copy's source, a
    tensor operand)."""
    if op_name(write.func) == "copy_":
        return True
    operands = [*write.args[1:], *write.kwargs.values()]
    return any(isinstance(x, Ref | Const) for x in tree_leaves(operands))


def _last_overwrite(storage: Storage, writes: list[Write]) -> int:
    """The index of the last write in ``writes`` that overwrites the whole storage without
    reading it; -1 if none."""
    for i in range(len(writes) - 1, -1, -1):
        w = writes[i]
        if op_name(w.func) in _OVERWRITES and w.arg == 0 and _whole(w.target, storage.numel):
            return i
    return -1


def _arg(write: Write, index: int, name: str, default: float) -> float:
    if len(write.args) > index:
        return float(write.args[index])
    return float(write.kwargs.get(name, default))


def _arange_start_step(node: Node) -> tuple[float, float]:
    a, overload = node.args, node.func._overloadname
    if overload == "default":
        return 0, 1
    return a[0], (a[2] if overload == "start_step" and len(a) > 2 else 1)


def _flat_index(size: tuple[int, ...], coords: Coords) -> torch.Tensor:
    flat = torch.zeros_like(coords[0])
    for c, s in zip(coords, size, strict=True):
        flat = flat * s + c
    return flat
