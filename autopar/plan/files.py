"""Files written so that no reader sees half of one, and no two writers interleave.

`write_atomic(path, text)`: the text goes to a fresh temporary file in the same directory
(unique per writer), is flushed to disk, then renamed over ``path``: a reader sees the old
file or the new one, never a mix, and two writers never share a temporary file.

`directory_lock(directory)`: an exclusive lock (POSIX `flock`) on ``directory/.autopar.lock``
for as long as the block runs, so that `autopar.api.save` writes plan.json and train.py as a
pair: a second process saving into the same directory waits, and the pair left behind is one
plan's. (Across machines on a network filesystem where `flock` is not honoured, the generated
program still refuses a plan.json other than its own: `autopar.codegen`.)

Errors name the path and what the disk said (`PlanError`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from autopar.errors import AutoparError

LOCK_NAME = ".autopar.lock"


class PlanFileError(AutoparError, OSError):
    """A plan's directory or file cannot be made or written."""


def ensure_directory(directory: str | Path) -> Path:
    """``directory``, created with its parents if needed.

    Raises:
        PlanFileError: a file stands where the directory should, or it cannot be made.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise PlanFileError(f"{out}: is a file, not a directory: choose another directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanFileError(f"{out}: cannot make the directory: {e.strerror or e}") from None
    return out


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a unique temporary file and a rename.

    Raises:
        PlanFileError: the directory is not writable or the disk is full; ``path`` is as it
            was and no temporary file is left.
    """
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        need = len(text.encode())
        raise PlanFileError(f"{path}: cannot write {need:,} bytes: {e.strerror or e}") from None
    return path


@contextlib.contextmanager
def directory_lock(directory: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (module docstring) while the block runs."""
    import fcntl  # POSIX; autopar runs where torchrun does

    path = ensure_directory(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise PlanFileError(f"{path}: cannot open the lock file: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
