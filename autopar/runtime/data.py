"""Real data for the generated program: a tokenized file, memory-mapped, read by step and rank.

In: a file of token ids -- a flat array, the format nanoGPT's prepare scripts write (`.bin`,
uint16 unless told) or a NumPy `.npy` file (its own dtype) -- the sequence length and the
global batch. Out: `TokenFile`, a data hook `(step, start, stop) -> (inputs, targets)` as
`autopar.runtime.task` takes them.

Layout: the file is cut into W = tokens // seq_len windows of seq_len tokens. Step s (0-based)
reads windows s x B, ..., s x B + B - 1 (mod W) of the global batch B; a rank reads only its
rows [start, stop). The position is a function of the step alone, so a run resumed from a
checkpoint of step s reads exactly what an uninterrupted run reads next: mid-epoch resumption
needs no loader state. Epoch e covers steps [e x W / B, (e + 1) x W / B). Inputs and targets are
the same window (the language-model loss shifts by one position).

Only the pages of the windows read are touched (np.memmap), so a file larger than memory works.

Public: TokenFile(path, seq_len, global_batch_size, dtype=None), write_tokens(path, ids)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class TokenFile:
    """A data hook over a tokenized file (module docstring)."""

    def __init__(
        self, path: str | Path, seq_len: int, global_batch_size: int, dtype: str | None = None
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such token file")
        if self.path.suffix == ".npy":
            self.tokens = np.load(self.path, mmap_mode="r")
            if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
                raise ValueError(
                    f"{self.path}: a token file holds one flat array of integer ids, got "
                    f"shape {self.tokens.shape} of {self.tokens.dtype}"
                )
        else:
            self.tokens = np.memmap(self.path, dtype=np.dtype(dtype or "uint16"), mode="r")
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.num_windows = len(self.tokens) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"{self.path} holds {len(self.tokens):,} tokens, fewer than one sequence of "
                f"{seq_len}"
            )

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch_size

    def window(self, step: int, row: int) -> int:
        """Which window row ``row`` of step ``step``'s global batch reads."""
        return (step * self.global_batch_size + row) % self.num_windows

    def __call__(self, step: int, start: int, stop: int) -> Batch:
        rows = []
        for row in range(start, stop):
            first = self.window(step, row) * self.seq_len
            rows.append(np.asarray(self.tokens[first : first + self.seq_len], dtype=np.int64))
        ids = torch.from_numpy(np.stack(rows))
        return (ids,), ids

    def max_token(self) -> int:
        return int(self.tokens.max())


def write_tokens(path: str | Path, ids: np.ndarray | list[int], dtype: str = "uint16") -> Path:
    """Write ``ids`` as a flat token file (`.npy` with its dtype, else raw ``dtype``)."""
    path = Path(path)
    array = np.asarray(ids, dtype=np.dtype(dtype))
    if path.suffix == ".npy":
        np.save(path, array)
    else:
        array.tofile(path)
    return path
