"""A Hugging Face dataset as the generated program's token file (`--hf-dataset`).

In: a dataset source -- a directory `datasets.Dataset.save_to_disk` wrote, a local data file
`datasets.load_dataset` reads by its extension (.json/.jsonl, .csv, .parquet, .txt), or a Hub
name where the machine reaches the Hub -- its split, the column to train on, and for a text
column a tokenizer: a local directory `transformers.AutoTokenizer` loads, or "bytes" (each UTF-8
byte one id, as data/tokens/autopar-docs.bin). A column of token-id lists needs no tokenizer.
Out: a flat token file and its id type, read by `autopar.runtime.data.TokenFile` like any other,
so a step's rows are a function of the step and a resumed run reads what an uninterrupted one
would.

The documents are tokenized in order and concatenated, each followed by the tokenizer's
end-of-sequence id (bytes: a newline). The file is written once per dataset, split, column and
tokenizer into a cache directory (`AUTOPAR_CACHE`, default ~/.cache/autopar), under a name
holding the dataset's fingerprint, through a temporary file renamed into place; on several
ranks the first rank of each node writes it and every rank waits (`node_token_file`). Batches
are tokenized and appended in turn, so the dataset need not fit in memory.

This is not `datasets`' own map-and-cache: that caches Arrow tables of ids per document, where
the program reads a flat memory-mapped array by window.

A source, split, column or tokenizer that cannot be read is refused with one line naming the
option (`preflight.RunError`), whatever `datasets` or `transformers` raised: a malformed data
file, a Hub name the machine cannot reach, a tokenizer directory that does not load.

Public: hf_token_file(source, split, column, tokenizer, cache_dir=None) -> (path, dtype),
        node_token_file(...) the same on every rank of a process group
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from autopar.runtime.preflight import RunError

FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
BATCH = 1000  # documents tokenized and appended at a time


def hf_token_file(
    source: str,
    split: str = "train",
    column: str = "text",
    tokenizer: str | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[Path, str]:
    """The token file of ``source``'s ``split`` / ``column`` (module docstring), written when
    the cache does not hold it yet; returns its path and id type ("uint16" or "uint32")."""
    dataset = _load(source, split)
    if column not in dataset.column_names:
        raise RunError(
            f"{source} ({split}) has no column {column!r}: its columns are "
            f"{', '.join(dataset.column_names)} (--hf-column)"
        )
    encode, eos, vocab = _encoder(dataset.features[column], tokenizer, source, column)
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    key = "\0".join([source, split, column, tokenizer or "", dataset._fingerprint, dtype])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() else "-" for c in Path(source).name or source)[:40]
    cache = Path(cache_dir or Path(os.environ.get("AUTOPAR_CACHE", "~/.cache/autopar")) / "tokens")
    path = cache.expanduser() / f"{name}-{split}-{digest}.{dtype}.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # one name per writer: nodes sharing a file system may each write it
        tmp = path.with_suffix(f".{socket.gethostname()}-{os.getpid()}.tmp")
        count = _write(dataset.iter(batch_size=BATCH), column, encode, eos, np.dtype(dtype), tmp)
        if count == 0:
            tmp.unlink()
            raise RunError(f"{source} ({split}, column {column!r}) holds no tokens")
        os.replace(tmp, path)  # whole or absent: a reader never sees a partial file
    return path, dtype


def node_token_file(*args, **kwargs) -> tuple[Path, str]:
    """`hf_token_file` on every rank of the default process group: the first rank of each node
    (LOCAL_RANK 0) writes the file, the others wait for it (a collective). A refusal there
    (a missing column, an unreadable source) is gathered by every rank, so every rank stops
    with it and none tries the source again (a Hub name offline would time out once per rank)."""
    import torch.distributed as dist

    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    failed: Exception | None = None
    if first:
        try:
            found = hf_token_file(*args, **kwargs)
        except Exception as e:  # re-raised once every rank knows
            failed = e
    said = [None if failed is None else str(failed)]
    if dist.is_initialized():
        said = [None] * dist.get_world_size()
        dist.all_gather_object(said, None if failed is None else str(failed))
    if failed is not None:
        raise failed
    elsewhere = next((s for s in said if s), None)
    if elsewhere is not None:
        raise RunError(f"on another node: {elsewhere}")
    if not first:
        found = hf_token_file(*args, **kwargs)  # in the cache now: only reads the dataset
    return found


def _load(source: str, split: str):
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "--hf-dataset needs the datasets package: pip install datasets (or train on a "
            "token file with --tokens)"
        ) from err
    path = Path(source).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise RunError(
                f"--hf-dataset {source}: not a data file datasets reads by extension "
                f"({', '.join(FILE_BUILDERS)}) nor a save_to_disk directory"
            )
        if split != "train":  # a single data file is read as one split, "train"
            raise RunError(
                f"--hf-split {split!r}: {source} is one data file, read as the split 'train'; "
                "name a directory or a Hub dataset for other splits"
            )
    try:
        if path.is_dir():  # save_to_disk's: a DatasetDict of splits, or one Dataset
            saved = datasets.load_from_disk(str(path))
            if not isinstance(saved, datasets.DatasetDict):
                return saved
            if split not in saved:
                raise RunError(f"--hf-split {split!r}: {source} holds the splits "
                               f"{', '.join(saved)}")  # fmt: skip
            return saved[split]
        if path.is_file():
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        return datasets.load_dataset(source, split=split)
    except RunError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever datasets raises: one line naming it
        raise RunError(f"--hf-dataset {source}: cannot be read ({_reason(e)})") from None


def _reason(error: BaseException, limit: int = 400) -> str:
    """An exception and the one it was raised from, in one line: datasets wraps a parse
    error in "An error occurred while generating the dataset"."""
    parts = [f"{type(error).__name__}: {error}"]
    if error.__cause__ is not None:
        parts.append(f"{type(error.__cause__).__name__}: {error.__cause__}")
    text = " ".join("; ".join(parts).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _encoder(
    feature, tokenizer: str | None, source: str, column: str
) -> tuple[Callable[[list], list[list[int]]], list[int], int]:
    """How a batch of ``column`` becomes id lists, the ids closing each document, and the
    vocabulary size (which sets the file's id type)."""
    if _holds_ids(feature):
        return (lambda batch: batch), [], 2**32
    if tokenizer is None:
        raise RunError(
            f"column {column!r} of {source} holds text: name a tokenizer (--tokenizer: a local "
            "tokenizer directory, or 'bytes' for UTF-8 bytes as ids)"
        )
    if tokenizer == "bytes":
        return (lambda batch: [list(text.encode("utf-8")) for text in batch]), [10], 256
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises: one line naming it
        raise RunError(f"--tokenizer {tokenizer}: does not load ({_reason(e)})") from None
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]

    def encode(batch: list[str]) -> list[list[int]]:
        return tok(batch, add_special_tokens=False)["input_ids"]

    return encode, eos, len(tok)


def _holds_ids(feature) -> bool:
    inner = getattr(feature, "feature", None)  # Sequence / List of a Value
    dtype = getattr(inner, "dtype", "")
    return inner is not None and (dtype.startswith("int") or dtype.startswith("uint"))


def _write(
    batches: Iterable[dict],
    column: str,
    encode: Callable[[list], list[list[int]]],
    eos: list[int],
    dtype: np.dtype,
    out: Path,
) -> int:
    count = 0
    with open(out, "wb") as f:
        for batch in batches:
            ids = [token for doc in encode(batch[column]) for token in (*doc, *eos)]
            array = np.asarray(ids, dtype=np.int64)
            if array.size and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
                raise RunError(f"token ids outside {dtype} in column {column!r}")
            array.astype(dtype).tofile(f)
            count += array.size
    return count
