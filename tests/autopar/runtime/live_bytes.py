"""Live tensor bytes of a run and their peak, measured on any device: what an allocator holds.

`LiveBytes` is a dispatch mode: every storage an op inside it makes is counted once from its
making until it is freed (a weakref finalizer on the storage), so `peak` is the most bytes
alive at once -- `torch.cuda.max_memory_allocated()` on the CPU, without an allocator's
rounding. Storages made before the mode (a model built outside it) are not counted; views share
their base's storage; a DTensor is counted by its local shard (its own storage is a wrapper's:
without this, tensor-parallel activations went uncounted and a TP2 run's peak was its
parameters' and optimizer's alone). torch's `MemTracker` counts the same by module but refuses
a module called twice in one step (gradient accumulation), which every multi-micro-batch run
does.

A storage is known by its StorageImpl, and its bytes are read again whenever an op touches it
and before a new peak is taken: FSDP2 frees an unsharded parameter by resizing its storage to
0 bytes and gathers it again by resizing it back, neither through the dispatcher. Counted by
data pointer and never re-read, as before, each gather to a new address counted the parameters
again and the freed ones stayed counted: ZeRO-3 over four micro-batches measured 1.15x its plan
on 2 ranks and 1.4-1.7x on 4, bytes no allocator held.

What it cannot see: the ops a tensor subclass runs inside its own dispatch. torch's
`loss_parallel()` computes its log-softmax and that loss's backward inside DTensor's handlers,
so their transients (one more fp32 logit-sized tensor than the fused kernels hold) are not
counted; tests/autopar/estimate/test_loss_peak.py measures the loss by the profiler's
allocator events instead.

Its bf16 and fp16 matrix products on the CPU are computed in fp32 and cast back: the same
output bytes, the values to rounding. Bytes are what it measures, and a CPU without bf16 GEMM
instructions (AVX2 alone) multiplies bf16 at 0.55 GFLOP/s against 43 in fp32: one rank's two
steps of the memory-peak test's Llama took 50 s, 44 of them in `aten.mm`.

With ``keep=True``, `at_peak` holds each storage live at the peak as (bytes, op, shape, dtype):
what was held (a copy at every new peak: slow, for looking into a figure).
"""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_GEMMS = frozenset(getattr(torch.ops.aten, op).default for op in ("mm", "addmm", "bmm", "baddbmm"))
_LOW = (torch.bfloat16, torch.float16)


def _in_fp32(func, args: tuple, kwargs: dict) -> torch.Tensor | None:  # noqa: ANN001
    """``func``'s bf16/fp16 CPU matrix product computed in fp32, cast back (module docstring);
    None for any other op."""
    if func not in _GEMMS:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dtype = tensors[0].dtype if tensors else None
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)  # no MXTensor
    if (
        not plain
        or dtype not in _LOW
        or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors)
    ):
        return None
    wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*wide, **kwargs).to(dtype)


class LiveBytes(TorchDispatchMode):
    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.keep = keep
        self.live = 0
        self.peak = 0
        self.held: dict[int, tuple[int, str, tuple[int, ...], str]] = {}
        self.at_peak: dict[int, tuple[int, str, tuple[int, ...], str]] = {}
        self._storages: dict[int, weakref.ref] = {}

    def _free(self, key: int) -> None:
        entry = self.held.pop(key, None)
        self._storages.pop(key, None)
        if entry is not None:
            self.live -= entry[0]

    def _resized(self, key: int, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s bytes as they are now (resized since it was last read)."""
        nbytes, *rest = self.held[key]
        now = storage.nbytes()
        if now != nbytes:
            self.held[key] = (now, *rest)  # type: ignore[assignment]
            self.live += now - nbytes

    def _take_peak(self) -> None:
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is not None:
                self._resized(key, storage)
        if self.live > self.peak:
            self.peak = self.live
            if self.keep:
                self.at_peak = dict(self.held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = _in_fp32(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard on this rank
            try:
                storage = t.untyped_storage()
                key = StorageWeakRef(storage).cdata  # the StorageImpl: kept across resize_
            except RuntimeError:  # a wrapper subclass, or a storage-less tensor
                continue
            if key in self.held:
                self._resized(key, storage)
                continue
            nbytes = storage.nbytes()
            if not nbytes:
                continue
            self.held[key] = (nbytes, func.__name__, tuple(t.shape), str(t.dtype))
            self._storages[key] = weakref.ref(storage)
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self._take_peak()
        return out
