"""CPU ranks: the host allocator made to hand freed tensor memory back (issue 44).

On a CPU rank the host is the device, and its resident set is what the plan's memory stands
for. glibc's malloc serves a request below its mmap threshold from its heap arenas and keeps
what is freed there for reuse; the threshold itself rises to the size of each mmap'd block
freed (up to 32 MiB), so after the first gathered block is freed every block, gradient and
activation of a small model comes from the heap, and the holes between live tensors stay
resident. Measured on 4 CPU ranks, a 0.1 B Llama under FSDP4 (benchmarks/startup.py --size
small): a resident peak of 2.0-2.5 GiB a rank where the live tensors (mallinfo2's in-use bytes
plus mmap'd ones) and the plan are about 1.1 GiB; with a fixed 128 KiB threshold, 1.22 GiB.

`release_freed_memory` sets that threshold (mallopt's M_MMAP_THRESHOLD, which also stops it
rising), so every tensor above it has pages of its own that free() returns to the system.
The price is a page fault per page of every new large tensor: the same model's steps took
17.4-18.0 s against 12.0-12.5 s (1.45x; 4 ranks on 2 cores at a load of 5,
`benchmarks/startup.py --size small --nproc 4 --config "fsdp=4 | zero=3" --steps 4` with and
without `--release-host-memory`), and a startup 2-3x as long, so the trainer sets it after the
startup, and it is an option: for a run that needs the memory it plans (`train.py
--release-host-memory`); the program's end-of-run line says when a CPU rank's peak far exceeds
its plan.

Written by hand: PyTorch has no CPU caching allocator to configure, and the usual remedy
(jemalloc or tcmalloc by LD_PRELOAD) must be installed and set before the process starts;
mallopt is glibc's own switch, called through ctypes. Not glibc (musl, macOS): a no-op that
says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 128 * 1024  # glibc's own starting threshold, kept fixed


def release_freed_memory(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where the C
    library is not glibc (or refuses), and nothing changed."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not mallopt(M_MMAP_THRESHOLD, threshold):
        return False
    libc.malloc_trim(0)  # what the heaps hold free already goes back too
    return True
