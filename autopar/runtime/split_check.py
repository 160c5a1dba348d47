"""Whether a model's own code computes on tensor-parallel slices what it computes whole.

In: the model, one sample's inputs as meta tensors, and the block linears the trace made column- or
row-parallel (`autopar.estimate.tables.tensor_parallel_roles`). Out: the roles the runtime may
apply, and why it may not apply the others.

autopar's runtime hands the output of a column-parallel projection to the model's code as the
rank's slice of its features, as torchtitan and Megatron do. For projections it knows by name
(`tensor_parallel.COLUMN_NAMES`) that code is known to read heads by "-1" and so computes on
the rank's heads. For any other, the trace says which projections a Megatron pair splits, but
not whether the code around them reads their outputs by position: Phi-3 cuts its fused qkv at
fixed offsets and chunks its fused gate_up in two, so a rank's slice would hold parts of each
piece, and T5 views its heads by a fixed count. Two checks on the meta device (any model size,
no memory, no ranks) catch these:

- the model runs with those linears at their tensor-parallel widths (tp = 2) and returns
  outputs of the shapes it returns whole: a fixed head count or width fails here;
- no column-parallel output is cut along its features where it is made (split, chunk, a
  slice, narrow, unbind): a fused projection cut by position is refused. A view into heads
  before a cut (GPT-NeoX's per-head fused qkv) passes: each head's pieces are then in one
  rank's slice.

What they do not prove: code that first views features into (pieces, heads) and then cuts the
pieces would pass and be wrong on ranks. The suite's any-model matrix runs each family it
names against one process (`tests/autopar/runtime/test_any_model.py`).

Public functions:
    checked_roles(model, roles, inputs) -> (roles the runtime applies, why not: "")
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.runtime.tensor_parallel import COLUMN_NAMES, ROW_NAMES

_WAYS = 2  # the smallest split shows a code that reads by position
# the calls that cut a tensor into pieces (functions and methods)
_CUTS = frozenset(
    {
        torch.split, torch.chunk, torch.tensor_split, torch.narrow, torch.unbind,
        torch.Tensor.split, torch.Tensor.chunk, torch.Tensor.tensor_split,
        torch.Tensor.narrow, torch.Tensor.unbind, torch.Tensor.__getitem__,
    }
)  # fmt: skip


def checked_roles(
    model: nn.Module, roles: dict[str, str], inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, str], str]:
    """The traced ``roles`` of linears the Megatron names do not cover, when ``model``'s code
    computes on their slices (module docstring), with ""; else ({}, why). Named ones are
    left to the name rule."""
    listed = tuple(
        f"{path}."
        for path, m in model.named_modules()
        if path and isinstance(m, nn.ModuleList | nn.ModuleDict)
    )  # the repeated blocks' (a chain of linears gets `tp_plan`'s alternation instead)
    traced = {
        p: r
        for p, r in roles.items()
        if p.rsplit(".", 1)[-1] not in COLUMN_NAMES | ROW_NAMES and p.startswith(listed)
    }
    for path in traced:
        if not isinstance(module := _module(model, path), nn.Linear):
            kind = type(module).__name__
            return {}, (
                f"{path} ({kind}) multiplies by its weights in its own code, not through an "
                "nn.Linear the runtime can split"
            )
    if not traced:
        return {}, ""
    why = _problem(model, traced, inputs)
    return ({}, why) if why else (traced, "")


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _problem(model: nn.Module, roles: dict[str, str], args: tuple[torch.Tensor, ...]) -> str:
    whole = _meta_state(model)
    local = dict(whole)
    for path, role in roles.items():
        linear = model.get_submodule(path)
        out_f, in_f = linear.weight.shape
        if (out_f if role == "col" else in_f) % _WAYS:
            return f"{path} has {out_f if role == 'col' else in_f} features, odd"
        shape = (out_f // _WAYS, in_f) if role == "col" else (out_f, in_f // _WAYS)
        local[f"{path}.weight"] = torch.empty(shape, dtype=linear.weight.dtype, device="meta")
        if role == "col" and linear.bias is not None:
            local[f"{path}.bias"] = torch.empty(
                out_f // _WAYS, dtype=linear.bias.dtype, device="meta"
            )
    try:
        want = _shapes(functional_call(model, whole, args))
    except Exception as e:  # data-dependent code (an .item()) cannot run on meta
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return f"its code does not run on the meta device ({type(e).__name__}: {first})"
    cuts = _CutWatch()
    hooks = [
        model.get_submodule(path).register_forward_hook(cuts.made(path))
        for path, role in roles.items()
        if role == "col"
    ]
    try:
        with cuts:
            got = _shapes(functional_call(model, local, args))
    except Exception as e:  # the model's own code failing at the local widths is the finding
        return (
            f"its code fails with {_named(roles)} at 1/{_WAYS} of their features "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
    finally:
        for h in hooks:
            h.remove()
    if cuts.found:
        path, name = cuts.found
        return (
            f"its code cuts {path}'s output along its features by position ({name}): a fused "
            "projection, whose pieces a rank's slice would mix"
        )
    if got != want:
        return f"its outputs at 1/{_WAYS} of {_named(roles)}'s features have other shapes"
    return ""


def _meta_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as an empty meta tensor of its shape."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in named}


def _shapes(out: Any) -> list[tuple[int, ...]]:
    leaves, _ = tree_flatten(out)
    if not leaves and hasattr(out, "to_tuple"):  # a Hugging Face ModelOutput
        leaves, _ = tree_flatten(out.to_tuple())
    return [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]


class _CutWatch(TorchFunctionMode):
    """Notes the first cut of a column-parallel output along its last dimension, right where
    the projection made it (`_CUTS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, tuple[str, torch.Tensor]] = {}  # the tensors kept alive
        self.found: tuple[str, str] | None = None

    def made(self, path: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                self.outputs[id(out)] = (path, out)

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        source = args[0] if args else None
        watched = isinstance(source, torch.Tensor) and id(source) in self.outputs
        if func in _CUTS and self.found is None and watched:
            width = source.shape[-1]
            pieces = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if any(t.dim() == source.dim() and t.shape[-1] < width for t in pieces):
                self.found = (self.outputs[id(source)][0], getattr(func, "__name__", str(func)))
        return out


def _named(roles: dict[str, str]) -> str:
    first = next(iter(roles))
    return first if len(roles) == 1 else f"{first} and {len(roles) - 1} other projections"
