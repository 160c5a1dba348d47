"""Pretrained weights in: a Hugging Face checkpoint read shard by shard, each rank only its bytes.

In: a directory holding `model.safetensors`, or several files listed in
`model.safetensors.index.json` (what `save_pretrained` writes), the model on the meta device
(its names, and the key conversions transformers applies when it loads this family), and the
record of its build (`record.InitRecord`: tied names, and the buffers no checkpoint holds).
Out: a `materialize.WeightSource` whose `fill(name, local, region)` reads the elements of
``region`` of the checkpoint's tensor into this rank's local tensor, cast to its dtype (fp32
master weights from a bf16 checkpoint).

Reading: safetensors maps each file and a slice reads only the bytes of its rows and columns
(`safe_open(...).get_slice(key)[...]`); a region's index list is cut into runs of consecutive
indices, one slice per combination of runs (one for a plain shard, a few for FSDP over a
fused projection's pieces).

Key conversions: transformers 5 keeps a family's experts stacked (`mlp.experts.gate_up_proj`,
[E, 2I, H]) while its checkpoints, written by `save_pretrained`, keep one tensor per expert
(`block_sparse_moe.experts.3.w1.weight`). The conversions transformers registers for the
family (`conversion_mapping.get_model_conversion_mapping`: renamings, and converters of
`MergeModulelist(dim=0)` then optionally `Concatenate(dim)`) are applied to the checkpoint's
key names only: the stacked tensor is a view over the per-expert tensors (`_Stack`, `_Cat`),
and a shard of it reads the per-expert slices it covers -- never the whole stack. A converter
of another kind is refused, naming it.

Checked: every parameter of the model is found (under its name, a tied twin's, or a
conversion) with the model's shape; otherwise `CheckpointError` names the tensor and both
shapes. Buffers a checkpoint does not hold (a rotary table) come from the record.

Public functions:
    HFCheckpoint(directory, model, record, device="cpu")  # a WeightSource
    checkpoint_config(directory) -> path of its config.json
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.startup.materialize import InitWeights
from autopar.runtime.startup.record import InitRecord
from autopar.runtime.startup.regions import Region

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointFormatError(AutoparError, ValueError):
    """A Hugging Face checkpoint that does not hold the model's tensors as it needs them."""


@dataclass(frozen=True)
class _Leaf:
    """One tensor of one safetensors file."""

    reader: Any  # safe_open handle
    key: str
    shape: tuple[int, ...]

    def read(self, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        if not self.shape:
            return self.reader.get_tensor(self.key)
        return self.reader.get_slice(self.key)[tuple(slice(a, b) for a, b in box)]


@dataclass(frozen=True)
class _Stack:
    """Tensors of one shape stacked along a new first dimension (MergeModulelist(dim=0))."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def read(self, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        (lo, hi), rest = box[0], box[1:]
        return torch.stack([self.parts[e].read(rest) for e in range(lo, hi)])


@dataclass(frozen=True)
class _Cat:
    """Tensors concatenated along ``dim`` (Concatenate(dim))."""

    parts: tuple[Any, ...]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        lo, hi = box[self.dim]
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                sub = list(box)
                sub[self.dim] = (a - offset, b - offset)
                pieces.append(part.read(sub))
            offset += size
        return torch.cat(pieces, dim=self.dim)


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, whole start, length) of each run of consecutive indices in ``index``."""
    values = index.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == v:
            start, whole, length = runs[-1]
            runs[-1] = (start, whole, length + 1)
        else:
            runs.append((i, v, 1))
    return runs


def checkpoint_files(directory: str | Path) -> dict[str, Path]:
    """Tensor key -> the safetensors file holding it.

    Raises:
        CheckpointFormatError: no model.safetensors and no index, or an unreadable index.
    """
    root = Path(directory)
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{root / INDEX}: not a safetensors index: {e}") from None
        return {key: root / name for key, name in weight_map.items()}
    if (root / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(root / SINGLE, framework="pt") as f:
            return {key: root / SINGLE for key in f.keys()}  # noqa: SIM118 (not a dict)
    raise CheckpointFormatError(
        f"{root}: no Hugging Face checkpoint here (neither {SINGLE} nor {INDEX})"
    )


def checkpoint_config(directory: str | Path) -> Path:
    """The config.json of a checkpoint directory.

    Raises:
        CheckpointFormatError: the directory has none.
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointFormatError(f"{directory}: no config.json beside the weights")
    return path


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for ``model``'s family (none for a model that
    is not a transformers one)."""
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return renamings, converters


def _operations(converter: Any) -> int | None:
    """The Concatenate dim after MergeModulelist(dim=0), None for a merge alone.

    Raises:
        CheckpointFormatError: operations other than those."""
    names = [type(op).__name__ for op in converter.operations]
    if names == ["MergeModulelist"] and converter.operations[0].dim == 0:
        return None
    if names == ["MergeModulelist", "Concatenate"] and converter.operations[0].dim == 0:
        return converter.operations[1].dim
    raise CheckpointFormatError(
        f"transformers converts {converter.source_patterns} to {converter.target_patterns} by "
        f"{names}; autopar reads shards through MergeModulelist(dim=0) and Concatenate only"
    )


class HFCheckpoint:
    """A Hugging Face checkpoint as a `materialize.WeightSource` (module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        model: nn.Module,
        record: InitRecord,
        device: torch.device | str = "cpu",
    ) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        self.record = record
        self.init = InitWeights(record, device)
        self.parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        files = checkpoint_files(self.directory)
        readers = {f: safe_open(f, framework="pt") for f in set(files.values())}
        leaves = {k: _Leaf(readers[f], k, tuple(readers[f].get_slice(k).get_shape()))
                  for k, f in files.items()}  # fmt: skip
        self.tensors = self._targets(model, leaves)

    def _targets(self, model: nn.Module, leaves: dict[str, _Leaf]) -> dict[str, Any]:
        """Model name -> the checkpoint tensor (a leaf, or a stack of converted leaves)."""
        from transformers.core_model_loading import apply_renamings, rename_source_key

        renamings, converters = _conversions(model)
        names = {n: None for n, _ in model.state_dict(keep_vars=True).items()}
        prefix = getattr(model, "base_model_prefix", None)
        out: dict[str, Any] = {}
        # target -> source pattern index -> expert index -> leaf
        merged: dict[str, dict[int, dict[int, _Leaf]]] = defaultdict(lambda: defaultdict(dict))
        how: dict[str, Any] = {}
        for key, leaf in leaves.items():
            renamed = apply_renamings(key, renamings)
            for converter in converters:
                target, pattern = converter.rename_source_key(renamed)
                if pattern is None:
                    continue
                target, _ = rename_source_key(target, [], [], prefix, names)
                regex = re.escape(pattern).replace(r"\*", r"(\d+)")
                found = re.search(regex, renamed)
                expert = int(found.group(1)) if found and found.groups() else 0
                merged[target][converter.source_patterns.index(pattern)][expert] = leaf
                how[target] = converter
                break
            else:
                target, _ = rename_source_key(renamed, [], [], prefix, names)
                out[target] = leaf
        for target, by_source in merged.items():
            stacks = [_Stack(tuple(by_source[i][e] for e in sorted(by_source[i])))
                      for i in sorted(by_source)]  # fmt: skip
            dim = _operations(how[target])
            out[target] = stacks[0] if dim is None else _Cat(tuple(stacks), dim)
        return out

    def _tensor(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        for twin in self.record.aliases(name):  # a tied head: its embedding's tensor
            if twin in self.tensors:
                return self.tensors[twin]
        return None

    def whole_shape(self, name: str) -> tuple[int, ...]:
        return self.init.whole_shape(name)

    def fill(self, name: str, local: torch.Tensor, region: Region) -> None:
        tensor = self._tensor(name)
        if tensor is None:
            if name not in self.parameters:  # a buffer no checkpoint holds (rotary tables)
                self.init.fill(name, local, region)
                return
            raise CheckpointFormatError(
                f"{self.directory}: no tensor for the model's parameter {name} (nor a tied "
                "twin, nor a conversion of per-expert tensors)"
            )
        want = self.whole_shape(name)
        if tuple(tensor.shape) != tuple(want):
            raise CheckpointFormatError(
                f"{self.directory}: {name} is {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(want)} in the model"
            )
        runs = [_runs(index) for index in region.indices]
        for combo in product(*runs):
            box = [(whole, whole + n) for _, whole, n in combo]
            place = tuple(slice(start, start + n) for start, _, n in combo)
            data = tensor.read(box)
            local[place].copy_(data.to(device=local.device, dtype=local.dtype))
