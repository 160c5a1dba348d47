"""Whether a model's own code computes on tensor-parallel slices what it computes whole.

In: the model, one sample's inputs as meta tensors, and the block linears the trace made column- or
row-parallel (`autopar.estimate.tables.tensor_parallel_roles`). Out: the roles the runtime may
apply -- "col/N" for a fused projection of N pieces -- and why it may not apply the others.

autopar's runtime hands the output of a column-parallel projection to the model's code as the
rank's slice of its features, as torchtitan and Megatron do. For projections it knows by name
(`tensor_parallel.COLUMN_NAMES`) that code is known to read heads by "-1" and so computes on
the rank's heads. For any other, the trace says which projections a Megatron pair splits, but
not whether the code around them reads their outputs by position: T5 views its heads by a
fixed count. And a fused projection whose code cuts its output where it is made -- GPT-2's
`c_attn` by ``split(hidden)``, Phi-3's `qkv_proj` by slices and `gate_up_proj` by ``chunk(2)``
-- must be split piece by piece (`autopar.runtime.fused_pieces`), named or not. Two runs on
the meta device (any model size, no memory, no ranks) find these:

- whole, watching where each column-parallel output is cut along its features where it is
  made: cuts into pieces of one width make it a fused projection of that many pieces (each
  split over tp); pieces of different widths (Phi-3's q, k, v with fewer key/value heads) are
  refused, for no split of one tensor gives each rank its share of each;
- as the runtime runs them at tp = 2 (each split module computing whole, as a DTensor module
  does, its column outputs handed on as the rank's slice -- a fused one's as `Pieces` -- and
  its row inputs widened back): the model must return outputs of the shapes it returns whole,
  so a fixed head count or width fails here.

The tensors are fake ones of the CPU (`fake_like`; floats in bf16, which the fake grouped GEMM
of transformers' experts needs): code that reads values where it is not traced (transformers'
check for packed sequences, when it keeps no cache) takes its tracing path, as under
torch.export, and code that picks a kernel by the device takes the CPU's.

The second run covers the projections the runtime splits by name too: a model's code that
views their outputs by the config's head count (StableLM's `view(bsz, q_len, self.num_heads,
head_dim)`) fails there, and the model is then refused tensor parallelism
(`CheckedRoles.unsplittable`), for the runtime would split those projections and crash.

Both runs take one block of each kind (`few_blocks`: the first two of each list of repeated
blocks, and the first of each other kind), so a 126-block model costs what a 3-block one does;
what they find of a block holds for every block of its kind. A model whose code will not run
with its lists cut short is run whole.

Both runs also follow each column-parallel output through its reshapes (`share_views`): a view
as (pieces, heads, head width) makes a fused projection of those pieces (ModernBERT's Wqkv),
and a reshape of a rank's share that is not its share of the whole reshape (OPT's
``view(bsz, -1, heads, head_dim)``, which runs on half the features) is refused, naming it.

What they do not prove: a share read by position after an operation that mixes it with other
values (a fixed count in a matmul's or a norm's shape) passes where it runs. The suite's
any-model matrix runs each family it names against one process
(`tests/autopar/runtime/test_any_model.py`).

Public:
    checked_roles(model, roles, inputs) -> CheckedRoles(roles the runtime applies, why not,
                                                        why the named split fails)
    few_blocks(model) -> context: {block cut: block of its kind kept}   # also attention_check
    fake_like(t), meta_state(model)       # the fake tensors both checks run on
    whole_width_norm(model) -> "path (Class)" | None   # a q/k norm over a whole tp output
    wide_norm_refusal(norm) -> str                     # the refusal that names it
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.models.quiet import quiet_fake_tensors
from autopar.runtime.fused_pieces import CUTS, local_cut
from autopar.runtime.share_views import Reshape, ShareViews, misread, view_pieces
from autopar.runtime.tensor_parallel import (
    COLUMN_NAMES,
    ROW_NAMES,
    find_blocks,
    is_projection,
    transposed,
)

_WAYS = 2  # the smallest split shows a code that reads by position


class CheckedRoles(NamedTuple):
    """What `checked_roles` found: the roles the runtime applies beyond the name rule, why it
    holds back the others (""), and why the model's code fails with even the projections it
    splits by name split ("": they split; else tensor parallelism is refused)."""

    roles: dict[str, str]
    why: str
    unsplittable: str = ""
    # the block projections the estimate prices split (the trace's roles, `traced_roles`)
    priced: tuple[str, ...] = ()


def checked_roles(
    model: nn.Module,
    roles: dict[str, str],
    inputs: tuple[torch.Tensor, ...],
    cut: frozenset[str] | None = None,
) -> CheckedRoles:
    """The traced ``roles`` of block linears the Megatron names do not cover, and "col/N" for
    any column-parallel one, named or not, that is a fused projection of N pieces, when
    ``model``'s code computes on their slices (module docstring), with ""; else ({}, why).
    Named ones that are not fused are left to the name rule, once the model's code is seen to
    run with them split (else `CheckedRoles.unsplittable` says why not). ``cut``: the
    projections whose outputs the trace shows cut where they are made (None: any may be)."""
    listed = tuple(
        f"{path}."
        for path, m in model.named_modules()
        if path and isinstance(m, nn.ModuleList | nn.ModuleDict)
    )  # the repeated blocks' (a chain of linears gets `tp_plan`'s alternation instead)
    in_blocks = {p: r for p, r in roles.items() if p.startswith(listed)}
    traced = {
        p: r for p, r in in_blocks.items() if p.rsplit(".", 1)[-1] not in COLUMN_NAMES | ROW_NAMES
    }
    modules = {p: _module(model, p) for p in in_blocks}
    for path in traced:
        if not is_projection(modules[path]):
            kind = type(modules[path]).__name__
            why = (
                f"{path} ({kind}) multiplies by its weights in its own code, not through a "
                "linear layer the runtime can split"
            )
            return CheckedRoles({}, why)
    in_blocks = {p: r for p, r in in_blocks.items() if is_projection(modules[p])}
    if not in_blocks:
        return CheckedRoles({}, "")
    seen_cut = cut is not None and bool(cut & set(in_blocks))  # the trace shows a fused one
    # fake tensors (module docstring): code that reads values where it is not traced
    # (transformers' check for packed sequences, `is_tracing`) skips that read, as in export
    with quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        inputs = tuple(fake_like(t) for t in inputs)
        with few_blocks(model) as alike:
            if alike:  # the model with one block of each kind: its code's findings are theirs
                few = {p: r for p, r in in_blocks.items() if _like(p, alike) == p}
                found = _check(model, few, set(traced), seen_cut, inputs, short=True)
        if not alike or found is None:  # none dropped, or its code needs all its blocks
            alike, found = {}, _check(model, in_blocks, set(traced), seen_cut, inputs)
    if found.why or found.unsplittable:
        return found
    # each block's projections take the roles found for the block of its kind
    like = {p: _like(p, alike) for p in in_blocks}
    return CheckedRoles({p: found.roles[q] for p, q in like.items() if q in found.roles}, "")


def _check(
    model: nn.Module,
    in_blocks: dict[str, str],
    traced: set[str],
    seen_cut: bool,
    inputs: tuple[torch.Tensor, ...],
    short: bool = False,
) -> CheckedRoles | None:
    """`checked_roles`'s two runs over the model as it now is; None when ``short`` (its block
    lists cut to one of each kind) and the model's code does not run so."""
    whole = {k: fake_like(v) for k, v in meta_state(model).items()}
    traced = traced & set(in_blocks)
    named = {p: r for p, r in in_blocks.items() if p not in traced}
    try:
        pieces, want = _fused(model, whole, in_blocks, inputs)
    except _Unequal as e:
        return CheckedRoles({}, str(e))
    except Exception as e:  # data-dependent code (an .item()) cannot run on meta
        if short:
            return None
        if not traced and not seen_cut:
            return CheckedRoles({}, "")  # named only: the name rule, as it always was
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return CheckedRoles(
            {}, f"its code does not run on the meta device ({type(e).__name__}: {first})"
        )
    if why := _problem(model, whole, in_blocks, pieces, inputs, want):
        # the traced ones are held back; the named ones still split by name: do they run?
        failed = why
        if traced and named:
            alone = {p: n for p, n in pieces.items() if p in named}
            failed = _problem(model, whole, named, alone, inputs, want)
        return CheckedRoles({}, why, failed if named else "")
    checked = {**{p: in_blocks[p] for p in traced}, **{p: "col" for p in pieces}}
    return CheckedRoles(
        {p: f"{r}/{pieces[p]}" if p in pieces else r for p, r in checked.items()}, ""
    )


@contextmanager
def few_blocks(model: nn.Module) -> Iterator[dict[str, str]]:
    """``model`` with each list of repeated blocks (`find_blocks`) cut to its first two and the
    first of each other kind (`_kind`), the cut ones restored on exit; yields {a block cut:
    the block of its kind kept}. A fake run costs Python per operation, so a 126-block
    model's check takes what a 3-block one's does.
    The second block stays for code that hands the next block what the first made (T5's
    position bias)."""
    lists: dict[str, list[tuple[str, nn.Module]]] = {}
    for path, block in find_blocks(model):
        parent, _, name = path.rpartition(".")
        lists.setdefault(parent, []).append((name, block))
    alike: dict[str, str] = {}
    saved = []
    try:
        for parent, blocks in lists.items():
            first: dict[tuple, str] = {}
            keep = {}
            for i, (name, block) in enumerate(blocks):
                kind = _kind(block)
                if i < 2 or kind not in first:
                    keep[name] = block
                    first.setdefault(kind, f"{parent}.{name}" if parent else name)
                else:
                    alike[f"{parent}.{name}" if parent else name] = first[kind]
            if len(keep) < len(blocks):
                container = model.get_submodule(parent)
                saved.append((container, container._modules))
                container._modules = dict(keep)
        yield alike
    finally:
        for container, modules in saved:
            container._modules = modules


def _kind(block: nn.Module) -> tuple:
    """A block's kind: its modules' classes, its parameters' shapes, and its modules' plain
    settings -- strings and flags by value, numbers by whether they are set (a sliding layer's
    window against a full layer's None; not its index, which every block has its own of)."""
    settings = (
        (path, key, value if isinstance(value, str | bool) else value is None)
        for path, m in block.named_modules()
        for key, value in vars(m).items()
        if not key.startswith("_") and (value is None or isinstance(value, str | bool | int))
    )
    return (
        *((path, type(m).__name__) for path, m in block.named_modules()),
        *((path, tuple(p.shape), p.dtype) for path, p in block.named_parameters()),
        *settings,
    )


def _like(path: str, alike: dict[str, str]) -> str:
    """``path`` in the block of its kind `few_blocks` kept (itself when its block was kept)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if (kept := alike.get(".".join(parts[:i]))) is not None:
            return ".".join([kept, *parts[i:]])
    return path


class _Unequal(Exception):
    """A fused projection cut into pieces the runtime cannot split piece by piece (the message
    says how)."""


def _fused(
    model: nn.Module,
    whole: dict[str, torch.Tensor],
    roles: dict[str, str],
    args: tuple[torch.Tensor, ...],
) -> tuple[dict[str, int], _Whole]:
    """{column-parallel path: its number of pieces} for each whose output the code cuts along
    its features where it is made (or views as (pieces, heads, head width), `view_pieces`),
    into pieces of one width, each of two heads or more where the config says the head width;
    and what the model makes whole. Raises `_Unequal` otherwise: pieces of a head or less (a
    code that cuts heads apart) would be split inside a head."""
    head = _head_width(model)
    cuts = _CutWatch()
    hooks = [
        model.get_submodule(path).register_forward_hook(cuts.made(path))
        for path, role in roles.items()
        if role == "col"
    ]
    try:
        with cuts:
            shapes = _shapes(functional_call(model, whole, args))
    finally:
        for h in hooks:
            h.remove()
    for path in cuts.unread:
        raise _Unequal(f"its code cuts {path}'s output along its features, not contiguous")
    for path, (n, width) in view_pieces(cuts.views.reshapes, head).items():  # as (pieces, ..)
        cuts.bounds.setdefault(path, (width, set()))[1].update(width * i // n for i in range(n))
    out = {}
    for path, (width, bounds) in cuts.bounds.items():
        edges = sorted(bounds | {0, width})
        widths = [b - a for a, b in zip(edges, edges[1:], strict=False)]
        if len(set(widths)) > 1:
            raise _Unequal(
                f"its code cuts {path}'s output into pieces of {widths} features: a fused "
                "projection split over tp piece by piece needs pieces of one width"
            )
        if head and (widths[0] % head or widths[0] < 2 * head):
            raise _Unequal(
                f"its code cuts {path}'s output into pieces of {widths[0]} features, heads "
                f"being {head} wide: a fused projection split over tp piece by piece needs "
                "pieces of whole heads, two or more"
            )
        out[path] = len(widths)
    return out, _Whole(shapes, cuts.views.reshapes)


class _Whole(NamedTuple):
    """What the model makes whole: its outputs' shapes, and the reshapes of its column-parallel
    outputs (`share_views`)."""

    shapes: list[tuple[int, ...]]
    reshapes: list[Reshape]


def _head_width(model: nn.Module) -> int:
    """The attention heads' width a Hugging Face config gives, or 0."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    width = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if not width and heads and hidden:
        width = hidden // heads
    return int(width or 0)


def _problem(
    model: nn.Module,
    whole: dict[str, torch.Tensor],
    roles: dict[str, str],
    pieces: dict[str, int],
    args: tuple[torch.Tensor, ...],
    want: _Whole,
) -> str:
    """Why ``model`` run as the runtime splits ``roles`` at tp = 2 fails, changes its outputs'
    shapes, or reshapes a rank's share of a projection's output into other than its share of
    the whole (`share_views.misread`), or ""."""
    for path, role in roles.items():
        module = model.get_submodule(path)
        in_f, out_f = module.weight.shape if transposed(module) else module.weight.shape[::-1]
        width = out_f if role == "col" else in_f
        if width % (_WAYS * pieces.get(path, 1)):
            return f"{path} has {width} features, odd"
    hooks = []
    shares = _Shares()
    for path, role in roles.items():
        module = model.get_submodule(path)
        if role == "col":
            hooks.append(module.register_forward_hook(shares.hook(path, pieces.get(path, 1))))
        else:
            hooks.append(module.register_forward_pre_hook(_widened, with_kwargs=True))
            hooks.append(module.register_forward_hook(shares.row(path)))
    try:
        with shares:
            got = _shapes(functional_call(model, whole, args))
        if shares.changed:
            path, op = shares.changed
            return (
                f"its code changes {path}'s output in place ({op}): a row-parallel split hands "
                "it on as DTensor's to_local() view, which autograd does not let change (an "
                "out-of-place op, out = out + x, would split)"
            )
    except Exception as e:  # the model's own code failing at the local widths is the finding
        return (
            f"its code fails with {_named(roles)} at 1/{_WAYS} of their features "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
    finally:
        for h in hooks:
            h.remove()
    if got != want.shapes:
        return f"its outputs at 1/{_WAYS} of {_named(roles)}'s features have other shapes"
    whole = [r for r in want.reshapes if r.source in roles]
    return misread(whole, shares.views.reshapes, _WAYS)


class _Shares(TorchFunctionMode):
    """Column-parallel outputs as one rank's share at tp = 2 (the first half of each piece),
    a fused projection's cut at the local offsets as `fused_pieces.Pieces` cuts them (the
    check's tensors are fake, which a `Pieces` cannot wrap). Notes the first in-place op on a
    row-parallel output (`changed`: (path, op))."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (kept alive, piece)
        self.rows: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (path, kept alive)
        self.changed: tuple[str, str] | None = None
        self.views = ShareViews()

    def row(self, path: str):
        def made(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                self.rows[id(out)] = (path, out)

        return made

    def hook(self, path: str, pieces: int):
        def made(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            piece = out.shape[-1] // pieces
            cut = out.split(piece, dim=-1)
            share = torch.cat([p[..., : piece // _WAYS] for p in cut], dim=-1)
            if pieces > 1:
                self.fused[id(share)] = (share, piece)
            self.views.start(path, share, pieces)
            return share

        return made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUTS and args and id(args[0]) in self.fused:
            args, kwargs = local_cut(func, args, kwargs, _WAYS, self.fused[id(args[0])][1])
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.startswith("_") or name.startswith("__i")
        if in_place and args and id(args[0]) in self.rows and self.changed is None:
            self.changed = (self.rows[id(args[0])][0], name)
        out = func(*args, **kwargs)
        self.views.follow(func, args, kwargs, out)
        return out


def _widened(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: a row-parallel module's rank-slice input widened back to the whole,
    as the DTensor module sees it."""

    def wide(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * _WAYS, dim=-1)

    if args:
        return (wide(args[0]), *args[1:]), kwargs
    first = next(iter(kwargs))
    return args, {**kwargs, first: wide(kwargs[first])}


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def fake_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape on the CPU (fake, under a FakeTensorMode), floats in
    bf16: code that picks a kernel by device or makes tensors on the CPU runs as it does there,
    and the fake grouped GEMM of transformers' experts takes no dtype but bf16 (the real one
    does)."""
    dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="cpu")


def meta_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as an empty meta tensor of its shape."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in named}


def _shapes(out: Any) -> list[tuple[int, ...]]:
    leaves, _ = tree_flatten(out)
    if not leaves and hasattr(out, "to_tuple"):  # a Hugging Face ModelOutput
        leaves, _ = tree_flatten(out.to_tuple())
    return [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]


class _CutWatch(TorchFunctionMode):
    """Notes where each column-parallel output is cut along its last dimension, right where
    the projection made it (`CUTS`): {path: (its width, the offsets where its pieces start
    and end)}. A piece's offset is its storage offset from the output's (the cuts are views);
    an output whose last dimension is not contiguous is noted in `unread`."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, tuple[str, torch.Tensor]] = {}  # the tensors kept alive
        self.bounds: dict[str, tuple[int, set[int]]] = {}
        self.unread: set[str] = set()
        self.views = ShareViews()

    def made(self, path: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                self.outputs[id(out)] = (path, out)
                self.views.start(path, out)

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.views.follow(func, args, kwargs, out)
        source = args[0] if args else None
        if func not in CUTS or not isinstance(source, torch.Tensor):
            return out
        if (seen := self.outputs.get(id(source))) is None:
            return out
        width = source.shape[-1]
        pieces = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        cut = [t for t in pieces if t.dim() == source.dim() and t.shape[-1] < width]
        if not cut:
            return out
        bounds = self.bounds.setdefault(seen[0], (width, set()))[1]
        if source.stride(-1) != 1:  # no offsets to read
            self.unread.add(seen[0])
        row = source.stride(-2) if source.dim() > 1 else width  # a leading index's step
        for t in cut:
            start = (t.storage_offset() - source.storage_offset()) % row
            bounds.update((start, start + t.shape[-1]))
        return out


def _named(roles: dict[str, str]) -> str:
    first = next(iter(roles))
    return first if len(roles) == 1 else f"{first} and {len(roles) - 1} other projections"


def whole_width_norm(model: nn.Module) -> str | None:
    """The first q/k norm ("path (Class)") whose weight spans the whole output of the
    column-parallel projection it normalises (OLMo2's, over all heads at once), or None. Under
    tp each rank holds 1/tp of that output, so the norm's statistics would be a shard's:
    tensor parallelism would compute another model (and fails on the weight's shape)."""
    for path, block in find_blocks(model):
        for name, scope in block.named_modules():
            for norm_name in ("q_norm", "k_norm"):
                norm = getattr(scope, norm_name, None)
                proj = getattr(scope, norm_name[0] + "_proj", None)
                weight = getattr(norm, "weight", None)
                if (
                    isinstance(proj, nn.Linear)
                    and weight is not None
                    and weight.dim() == 1
                    and weight.numel() == proj.out_features > 1
                ):
                    where = ".".join(p for p in (path, name, norm_name) if p)
                    return f"{where} ({type(norm).__name__})"
    return None


def wide_norm_refusal(norm: str) -> str:
    return (
        f"{norm} normalises the whole output of a column-parallel projection, of which each "
        "tp rank holds a slice: its statistics would be a slice's (autopar's runtime splits "
        "per-head q/k norms only)"
    )
