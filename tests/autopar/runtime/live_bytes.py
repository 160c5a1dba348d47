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

With ``keep=True``, `at_peak` holds each storage live at the peak as (bytes, op, shape, dtype):
what was held (a copy at every new peak: slow, for looking into a figure).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.keep = keep
        self.live = 0
        self.peak = 0
        self.held: dict[int, tuple[int, str, tuple[int, ...], str]] = {}
        self.at_peak: dict[int, tuple[int, str, tuple[int, ...], str]] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self.held.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard on this rank
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
            except RuntimeError:  # a wrapper subclass, or a storage-less tensor
                continue
            nbytes = storage.nbytes()
            if key in self.held or not nbytes:
                continue
            self.held[key] = (nbytes, func.__name__, tuple(t.shape), str(t.dtype))
            self.live += nbytes
            weakref.finalize(storage, self._free, key, nbytes)
            if self.live > self.peak:
                self.peak = self.live
                if self.keep:
                    self.at_peak = dict(self.held)
        return out
