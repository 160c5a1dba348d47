"""Weights out: an autopar checkpoint written back as a Hugging Face checkpoint.

In: a complete checkpoint directory of `autopar.runtime.checkpoint` (DCP shards under the
parameters' own names; a Hugging Face expert stack sliced by hand under ep or etp, saved once
per slice as `<name>@ep1of2@tp0of2`, with its cuts in meta.json `hand_slices`), the model's
transformers config (a `PretrainedConfig`, or a config.json to copy) and a dtype. Out: a
directory `from_pretrained` loads:

    config.json                          the model's config, its dtype the weights'
    model.safetensors                    every tensor of the model's state dict, or
    model-0000k-of-0000n.safetensors     shards of at most `max_shard_bytes`, with
    model.safetensors.index.json         their weight map

One tensor at a time: each is read whole from DCP (`dcp.load(..., no_dist=True)` of that key
alone: its shards, whatever plan saved them) or joined from its hand slices
(`startup.regions` gives each slice's place), cast, and written with the shard it falls in;
the process holds one shard of the output and one tensor, never the model. Keys are the
model's own (transformers 5 stacks experts as `mlp.experts.gate_up_proj`, which its
`from_pretrained` reads as they are).

Public functions:
    export_hf(checkpoint, out, config, dtype=torch.float32, max_shard_bytes=5 GiB) -> ExportReport
    resolve_checkpoint(path) -> a complete checkpoint directory (a run's newest, or itself)
    save_hf_at_end(checkpointer, step, out, config, scratch) -> ExportReport  # collective
    save_run_as_hf(checkpointer | None, open_scratch, step, out, config)       # collective
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointOptions,
    checkpoint_problem,
    latest_checkpoint,
    read_meta,
)
from autopar.runtime.startup.regions import HandSlice, region_of

_TAG = re.compile(r"@(ep|tp)(\d+)of(\d+)")
MODEL_PREFIX = "model."  # the trainer saves {"model": ..., "optimizer": ...}; DCP flattens


@dataclass(frozen=True)
class ExportReport:
    directory: str
    num_tensors: int
    num_bytes: int
    files: tuple[str, ...]

    def as_text(self) -> str:
        return (
            f"wrote {self.num_tensors} tensors ({self.num_bytes / 2**20:,.1f} MiB) to "
            f"{self.directory} in {len(self.files)} file(s)"
        )


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest intact one in it.

    Raises:
        CheckpointError: none there, or the one named is damaged.
    """
    path = Path(path)
    chosen = path if (path / "meta.json").is_file() else latest_checkpoint(path)
    if chosen is None:
        raise CheckpointError(f"no complete autopar checkpoint in {path}")
    problem = checkpoint_problem(chosen)
    if problem is not None:
        raise CheckpointError(f"checkpoint {chosen} is damaged: {problem}")
    return chosen


def _model_keys(checkpoint: Path) -> dict[str, dict[str, TensorStorageMetadata]]:
    """Parameter name -> {saved key: its metadata}: one key, or one per hand slice."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    out: dict[str, dict[str, TensorStorageMetadata]] = defaultdict(dict)
    for key, meta in metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            saved = key[len(MODEL_PREFIX) :]
            out[_TAG.sub("", saved)][saved] = meta
    return out


def _read(checkpoint: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    dcp.load({"model": {key: tensor}}, checkpoint_id=str(checkpoint), no_dist=True)
    return tensor


def _joined(
    checkpoint: Path, name: str, saved: dict[str, TensorStorageMetadata], cuts: list
) -> torch.Tensor:
    """The whole parameter ``name`` from its hand slices (``cuts``: meta.json's [dim, pieces,
    num] per slice, in the order they were made, ep's then etp's)."""
    whole_shape: list[int] | None = None
    parts = []
    for key, meta in saved.items():
        ranks = {kind: int(rank) for kind, rank, _ in _TAG.findall(key)}
        order = [kind for kind, _, _ in _TAG.findall(key)]
        slices = [HandSlice(d, p, ranks[kind], n) for (d, p, n), kind in zip(cuts, order,
                  strict=True)]  # fmt: skip
        local = _read(checkpoint, key, meta)
        if whole_shape is None:
            whole_shape = list(local.shape)
            for cut in slices:
                whole_shape[cut.dim] *= cut.num
        parts.append((slices, local))
    whole = torch.empty(whole_shape or [], dtype=parts[0][1].dtype)
    for slices, local in parts:
        region = region_of(local, whole_shape, slices)
        whole[torch.meshgrid(*region.indices, indexing="ij")] = local
    return whole


def _write_config(config: Any, out: Path, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    if isinstance(config, str | Path):
        data = json.loads(Path(config).read_text())
        data.update({"torch_dtype": name, "dtype": name})
        (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
        return
    config = type(config).from_dict(config.to_dict())  # a copy: the caller's is not changed
    config.dtype = dtype
    config.save_pretrained(out)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
) -> ExportReport:
    """Write the model of autopar checkpoint ``checkpoint`` as a Hugging Face checkpoint in
    ``out`` (module docstring). ``config``: the model's transformers config, a config.json
    path, or None for the weights alone.

    Raises:
        CheckpointError: the checkpoint is damaged, holds no model, or slices it cannot join.
    """
    from safetensors.torch import save_file

    checkpoint = resolve_checkpoint(checkpoint)
    meta = read_meta(checkpoint)
    cuts = meta.get("hand_slices", {})
    keys = _model_keys(checkpoint)
    if not keys:
        raise CheckpointError(f"checkpoint {checkpoint} holds no model tensors")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    sizes = [0]
    total = 0
    written: list[Path] = []

    def flush() -> None:
        written.append(out / f".part-{len(written):05d}.safetensors")
        save_file(shards[-1], str(written[-1]), metadata={"format": "pt"})
        shards[-1] = {}
        sizes[-1] = 0

    for name in sorted(keys):
        saved = keys[name]
        if len(saved) == 1 and name in saved:
            tensor = _read(checkpoint, name, saved[name])
        elif name in cuts:
            tensor = _joined(checkpoint, name, saved, cuts[name])
        else:
            raise CheckpointError(
                f"checkpoint {checkpoint}: {name} is saved in slices {sorted(saved)} that its "
                "meta.json does not describe (a checkpoint of an older autopar)"
            )
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            flush()
        shards[-1][name] = tensor.contiguous()
        sizes[-1] += nbytes
        total += nbytes
        weight_map[name] = len(written)
    flush()
    files = _name_files(out, written, weight_map, total)
    if config is not None:
        _write_config(config, out, dtype)
    return ExportReport(str(out), len(weight_map), total, files)


def _name_files(
    out: Path, written: list[Path], weight_map: dict[str, int], total: int
) -> tuple[str, ...]:
    """Rename the parts to Hugging Face's names; an index when there is more than one."""
    if len(written) == 1:
        shutil.move(written[0], out / "model.safetensors")
        return ("model.safetensors",)
    n = len(written)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for part, name in zip(written, names, strict=True):
        shutil.move(part, out / name)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {key: names[i] for key, i in sorted(weight_map.items())},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return tuple(names)


def save_hf_at_end(
    checkpointer: Checkpointer, step: int, out: str | Path, config: Any, *, scratch: bool
) -> ExportReport | None:
    """The run's model after ``step`` steps as a Hugging Face checkpoint in ``out``: saved
    through ``checkpointer`` (unless its newest checkpoint is of that step), then exported by
    rank 0 (`export_hf`); ``scratch``: the checkpointer's directory is removed after. Collective:
    every rank calls it; rank 0 returns the report, the others None."""
    latest = latest_checkpoint(checkpointer.root)
    if latest is None or int(read_meta(latest)["step"]) != step:
        checkpointer.save(step)
    checkpointer.close()
    report = None
    if checkpointer.rank == 0:
        report = export_hf(checkpointer.root, out, config)
        if scratch:
            shutil.rmtree(checkpointer.root, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return report


def save_run_as_hf(
    checkpointer: Checkpointer | None,
    open_scratch: Callable[[CheckpointOptions], Checkpointer],
    step: int,
    out: str,
    config: Any,
    *,
    log: bool = True,
) -> None:
    """`TrainOptions.save_hf`: the model after ``step`` steps as a Hugging Face checkpoint in
    ``out``, saved through the run's ``checkpointer``, or through one ``open_scratch`` opens
    beside the output (removed after). Collective."""
    scratch = checkpointer is None
    if checkpointer is None:
        where = CheckpointOptions(f"{out}/.autopar-checkpoint", keep=1, resume=False)
        checkpointer = open_scratch(where)
    report = save_hf_at_end(checkpointer, step, out, config, scratch=scratch)
    if report is not None and log:
        print(f"[autopar] Hugging Face checkpoint: {report.as_text()}", flush=True)
