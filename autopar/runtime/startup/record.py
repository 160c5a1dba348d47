"""Recording a model's build on the meta device: how each parameter's value is made.

In: a function that builds a model (`Task.build_meta`), run on the meta device. Out: the model
(every parameter and buffer on meta, no memory) and an `InitRecord`: for each parameter and
buffer name, a `Ref` into a graph of the aten calls that made and wrote its storage --
factories (`empty`, `ones`, `arange`, `randn`), the in-place writes of its initialization
(`uniform_` from `kaiming_uniform_`, `normal_`, `fill_`, `copy_` of a rotary table computed on
the CPU) and the out-of-place ops between them (`mul`, `_to_copy`). `autopar.runtime.startup.
replay` evaluates that graph at any positions of a tensor, so a rank computes only its shard.

The record is taken below autograd, by a `TorchDispatchMode` (torchdistx's deferred init
did the same in C++; it is no longer kept for current torch, hence this module):
- a call whose output holds a storage not seen before adds a `Node` (the storage's creator);
- a call that writes an argument (schema `Tensor(a!)`) appends a `Write` to that argument's
  storage, with the view it wrote through (size, stride, offset);
- a tensor argument is read as a `Ref`: its storage, its view, and how many writes the storage
  had when it was read (so a later write does not change what an earlier op saw); a real
  tensor argument (a table computed on the CPU) is kept as a `Const` copy.
Views need no record: a view's output shares its input's storage.

Randomness: each random call gets a key from the generator's seed (the seed the factory set,
`torch.manual_seed`, or the `generator=` it passed) and the call's index in the build; the
replay draws from `autopar.runtime.startup.rng` at each element's storage position with that
key. The draws of a parameter therefore depend on the seed and the build only, never on the
plan, the rank or the order in which shards are made.

Public functions:
    record_build(build, seed=0) -> (model, InitRecord)
    InitRecord.source(name) -> Ref | Const;  InitRecord.aliases(name) -> tied names
    Ref, Const, Node, Write, Storage, Layout
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from autopar.runtime.startup.rng import mix_key


@dataclass(frozen=True)
class Layout:
    """How a tensor views its storage: sizes, strides and offset, in elements."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        return Layout(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


@dataclass(frozen=True, eq=False)
class Const:
    """A real tensor an op read (a table computed on the CPU): its values, copied."""

    tensor: torch.Tensor


@dataclass(frozen=True, eq=False)
class Node:
    """An aten call that made a new storage: its output number ``output`` is that storage's
    first value. ``key``: the random key of a random factory, else None."""

    func: Any
    args: tuple
    kwargs: dict
    output: int
    key: int | None


@dataclass(frozen=True, eq=False)
class Write:
    """An aten call that wrote ``target`` (a view of the storage): ``args[arg]`` or the keyword
    ``arg`` is the written tensor. ``key``: the random key of a random write."""

    func: Any
    target: Layout
    args: tuple
    kwargs: dict
    arg: int | str
    key: int | None


@dataclass(eq=False)
class Storage:
    """A meta storage of the build: its creator, the layout of the creator's output in it, and
    the writes after it, in order."""

    index: int
    dtype: torch.dtype
    numel: int
    creator: Node
    layout: Layout
    writes: list[Write] = field(default_factory=list)
    anchor: torch.Tensor | None = None  # keeps the meta storage alive: its identity unique


@dataclass(frozen=True, eq=False)
class Ref:
    """A tensor as read: ``storage`` after its first ``version`` writes, seen through
    ``layout``."""

    storage: Storage
    layout: Layout
    version: int

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


Source = Ref | Const

# aten ops that draw random numbers (their overload packets' names)
RANDOM = frozenset(
    {
        "uniform_", "normal_", "normal", "rand", "randn", "rand_like", "randn_like", "randint",
        "randint_like", "randperm", "bernoulli", "bernoulli_", "exponential_", "geometric_",
        "log_normal_", "cauchy_", "random_", "multinomial", "native_dropout",
    }
)  # fmt: skip


def op_name(func: Any) -> str:
    return func._overloadpacket.__name__


class InitRecordError(RuntimeError):
    """A parameter or buffer whose making the record cannot replay."""


@dataclass
class InitRecord:
    """What `record_build` saw: each parameter's and buffer's name -> its source."""

    sources: dict[str, Source]
    num_storages: int

    def aliases(self, name: str) -> list[str]:
        """The other names of the tensor ``name`` (a head tied to its embedding)."""
        mine = self.sources.get(name)
        if not isinstance(mine, Ref):
            return []
        return [
            other
            for other, source in self.sources.items()
            if other != name
            and isinstance(source, Ref)
            and source.storage is mine.storage
            and source.layout == mine.layout
        ]

    def source(self, name: str) -> Source:
        try:
            return self.sources[name]
        except KeyError:
            raise InitRecordError(
                f"{name} was not made by the model's factory (the build autopar recorded on "
                f"the meta device); known: {len(self.sources)} parameters and buffers"
            ) from None


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, Storage] = {}
        self.random_calls = 0
        self.last_seed: int | None = None  # the seed the last random call drew under

    def storage_of(self, t: torch.Tensor) -> Storage | None:
        return self.storages.get(StorageWeakRef(t.untyped_storage()))

    def read(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not x.is_meta:
            return Const(x.detach().clone())
        storage = self.storage_of(x)
        if storage is None:
            raise InitRecordError(
                f"a meta tensor {tuple(x.shape)} made before the recorded build was read by it"
            )
        return Ref(storage, Layout.of(x), len(storage.writes))

    def _key(self, func: Any, kwargs: dict) -> int | None:
        if op_name(func) not in RANDOM:
            return None
        generator = kwargs.get("generator")
        seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        self.last_seed = seed
        self.random_calls += 1
        return mix_key(seed, self.random_calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(_is_meta(t) for t in tree_leaves((args, kwargs))):
            # real tensors only (a rotary table computed on the CPU): nothing of the model's,
            # unless it makes a meta tensor from them (a factory under the meta device, a
            # copy to meta), which does not write its real inputs: read them after
            out = func(*args, **kwargs)
            if not any(_is_meta(t) for t in tree_leaves(out)):
                return out
            read_args, read_kwargs = tree_map(self.read, (tuple(args), dict(kwargs)))
            self._made(func, out, read_args, read_kwargs, self._key(func, kwargs))
            return out
        read_args, read_kwargs = tree_map(self.read, (tuple(args), dict(kwargs)))
        key = self._key(func, kwargs)
        out = func(*args, **kwargs)
        for i, schema_arg in enumerate(func._schema.arguments):
            if schema_arg.alias_info is None or not schema_arg.alias_info.is_write:
                continue
            where: int | str = i if i < len(args) else schema_arg.name
            target = args[i] if i < len(args) else kwargs.get(schema_arg.name)
            for t in tree_leaves(target):  # a Tensor(a!)[] argument writes several
                if isinstance(t, torch.Tensor) and t.is_meta:
                    storage = self.storage_of(t)
                    if storage is None:
                        raise InitRecordError(f"{func} wrote a meta tensor made before the build")
                    write = Write(func, Layout.of(t), read_args, read_kwargs, where, key)
                    storage.writes.append(write)
        self._made(func, out, read_args, read_kwargs, key)
        return out

    def _made(self, func: Any, out: Any, args: tuple, kwargs: dict, key: int | None) -> None:
        """A storage per output of ``func`` on a meta storage not seen before."""
        for j, o in enumerate(tree_leaves(out)):
            if _is_meta(o) and self.storage_of(o) is None:
                numel = o.untyped_storage().nbytes() // max(1, o.element_size())
                node = Node(func, args, kwargs, j, key)
                storage = Storage(len(self.storages), o.dtype, numel, node, Layout.of(o))
                storage.anchor = o
                self.storages[StorageWeakRef(o.untyped_storage())] = storage


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


class _TensorsOnCpuFirst(TorchFunctionMode):
    """`torch.tensor(data)` / `torch.as_tensor(data)` aimed at the meta device made on the CPU
    and moved: made on meta directly, the data never passes the dispatcher (the recorder
    would see a tensor of unknown value, as Gemma 2's `nn.Buffer(torch.tensor(scale))`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            if device is None:
                device = torch.get_default_device()
            if torch.device(device).type == "meta":
                made = func(*args, **{**kwargs, "device": "cpu"})
                return made.to("meta")
        return func(*args, **kwargs)


def _trunc_normal(tensor, mean, std, a, b, generator=None):
    """torch.nn.init's truncated normal by inverse CDF, without its early return on meta
    tensors (torch 2.13 samples nothing there): the same in-place ops, for the recorder."""

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    low, high = cdf((a - mean) / std), cdf((b - mean) / std)
    with torch.no_grad():
        tensor.uniform_(2 * low - 1, 2 * high - 1, generator=generator)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
    return tensor


def _orthogonal(tensor, gain=1.0, generator=None):
    """torch.nn.init.orthogonal_ (a QR of a normal matrix, signs fixed by R's diagonal)
    without its early return on meta tensors."""
    if tensor.ndimension() < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    rows, cols = tensor.size(0), tensor.numel() // tensor.size(0)
    with torch.no_grad():
        flat = tensor.new_empty((rows, cols)).normal_(0, 1, generator=generator)
        if rows < cols:
            flat = flat.t()
        q, r = torch.linalg.qr(flat)
        q = q * torch.diag(r, 0).sign()
        if rows < cols:
            q = q.t()
        tensor.view_as(q).copy_(q)
        tensor.mul_(gain)
    return tensor


def _unsupported(name: str) -> Callable[..., Any]:
    def refuse(tensor, *args, **kwargs):
        raise InitRecordError(
            f"torch.nn.init.{name} on the meta device: autopar cannot record it (torch skips "
            "meta tensors there); initialize that parameter with another function"
        )

    return refuse


@contextmanager
def _init_functions_on_meta() -> Iterator[None]:
    """torch.nn.init's functions that return a meta tensor untouched, replaced for the
    recorded build by their in-place ops (transformers calls them through its own table)."""
    import torch.nn.init as init

    replaced = {
        "orthogonal_": _orthogonal,
        "dirac_": _unsupported("dirac_"),
        "sparse_": _unsupported("sparse_"),
    }
    tables: list[dict] = [vars(init)]
    hf_init = sys.modules.get("transformers.initialization")
    if hf_init is not None:
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    saved = [(t, k, t[k]) for t in tables for k in replaced if k in t]
    saved.append((vars(init), "_no_grad_trunc_normal_", init._no_grad_trunc_normal_))
    try:
        for table, key, _ in saved:
            table[key] = _trunc_normal if key == "_no_grad_trunc_normal_" else replaced[key]
        yield
    finally:
        for table, key, value in saved:
            table[key] = value


def _outermost_transformers(model: nn.Module) -> list[nn.Module]:
    """The transformers models in ``model`` not inside another (the model itself, or those a
    user's module wraps): each initializes its own submodels."""
    found: list[str] = []
    out = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in found):
            continue
        if callable(getattr(module, "initialize_weights", None)) and hasattr(
            module, "_init_weights"
        ):
            found.append(name)
            out.append(module)
    return out


def record_build(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, InitRecord]:
    """Run ``build()`` on the meta device under the recorder (`torch.manual_seed(seed)` first,
    the caller's RNG state restored after); the model and how each of its parameters and
    buffers was made. A transformers model, which skips its own initialization on the meta
    device, has it run here (`initialize_weights`; each one a user's module wraps), outside
    the meta device context so that its rotary tables are computed on the CPU, as a CPU build
    computes them.

    Raises:
        InitRecordError: a parameter or buffer the build did not make (a meta tensor made
            before it).
    """
    recorder = _Recorder()
    with torch.random.fork_rng(devices=[]), _init_functions_on_meta():
        torch.manual_seed(seed)
        with recorder:
            with torch.device("meta"), _TensorsOnCpuFirst():
                model = build()
            # under the seed the factory's build drew with (hf.build seeds its own and
            # restores the caller's RNG after): its seed argument decides these draws too
            torch.manual_seed(recorder.last_seed if recorder.last_seed is not None else seed)
            with torch.no_grad():
                for module in _outermost_transformers(model):
                    module.initialize_weights()
    sources: dict[str, Source] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if not t.is_meta:
            sources[name] = Const(t.detach())
            continue
        storage = recorder.storage_of(t)
        if storage is None:
            raise InitRecordError(f"{name} {tuple(t.shape)} was not made by the recorded build")
        sources[name] = Ref(storage, Layout.of(t), len(storage.writes))
    return model, InitRecord(sources, len(recorder.storages))
