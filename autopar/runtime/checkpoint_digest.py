"""Checkpoint files verified by content: a SHA-256 per file, recorded at save, checked at resume.

In: a checkpoint being written (its `.partial-step-N` directory) on every rank, or a complete
one at resume. Out: at save, each rank's digests of the files it wrote -- its DCP shards
(`__<rank>_<i>.distcp`, DCP's FileSystemWriter's names), its RNG file and its extra state -- in
`digest-rank<r>.json`, which rank 0 merges with the digest of `.metadata` into meta.json's
`sha256` (`collect`); at resume, the first file whose bytes no longer hash to what was recorded
(`problem`): a shard with 4 KiB flipped and its size unchanged is named, and the resume falls
back to the newest checkpoint that verifies.

Each rank hashes its own files right after writing them (the pages are still cached), so no
rank reads another's; rank 0 waits for the ranks' digest files (an asynchronous save's are
written by its future's callback), up to `WAIT_S`, and records what it has. The check at
resume reads every file once on rank 0 (about the time of reading the checkpoint itself).

Public functions:
    write_rank_digests(directory, rank)
    collect(directory, world_size) -> {file: sha256}
    problem(path, recorded) -> str | None
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

WAIT_S = 120.0  # how long rank 0 waits for a rank's digests
_CHUNK = 8 * 2**20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_rank_digests(directory: str | Path, rank: int) -> None:
    """Rank ``rank``'s digests of the files it wrote into ``directory``."""
    root = Path(directory)
    mine = [
        *root.glob(f"__{rank}_*.distcp"),
        *(root / f"{k}-rank{rank}.pt" for k in ("rng", "extra")),
    ]
    digests = {p.name: sha256_of(p) for p in mine if p.is_file()}
    tmp = root / f".digest-rank{rank}.json.tmp"
    tmp.write_text(json.dumps(digests))
    tmp.rename(root / f"digest-rank{rank}.json")  # whole or absent


def collect(directory: str | Path, world_size: int) -> dict[str, str]:
    """Rank 0: every rank's digests (waiting up to `WAIT_S` for them) and `.metadata`'s; the
    ranks' digest files are removed once merged."""
    root = Path(directory)
    deadline = time.monotonic() + WAIT_S
    files = [root / f"digest-rank{r}.json" for r in range(world_size)]
    while not all(f.is_file() for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    out: dict[str, str] = {}
    for f in files:
        if f.is_file():
            out.update(json.loads(f.read_text()))
            f.unlink()
    if (root / ".metadata").is_file():
        out[".metadata"] = sha256_of(root / ".metadata")
    return out


def problem(path: str | Path, recorded: dict[str, str]) -> str | None:
    """The first file of the checkpoint at ``path`` whose content differs from its recorded
    digest, in words; None when every recorded file hashes as written."""
    for name, want in sorted(recorded.items()):
        file = Path(path) / name
        if file.is_file() and sha256_of(file) != want:
            return f"{name} holds other bytes than were written (its SHA-256 differs)"
    return None
