"""Filling a parallelised meta model: each rank allocates and computes only its own shards.

In: the model after `parallelize_model` ran on the meta device (DTensors of TP and FSDP2,
expert slices cut by hand, pipeline chunks), the hand slices (`regions.HandSlice` by name), a
`WeightSource` and the device. Out: the same modules with every parameter and buffer on the
device, each holding exactly its shard's values of the whole model's tensor; a
`Materialized` record (tensors and elements filled).

    model.to_empty(device)                    # this rank's shards, uninitialized (FSDP2 too;
                                              # swapped in place: tied parameters stay tied)
    for each parameter and buffer (its original name):
        region = regions.region_of(local tensor, whole shape, hand slices)
        source.fill(name, local tensor, region)   # the init replay, or a checkpoint's bytes

Tied parameters are filled once (their module's first name); buffers under every name (each
module's slot is its own tensor after `to_empty`), so a rotary table that the meta build left
empty is computed (`record`'s replay of its making).

Public functions:
    WeightSource                 (protocol) .whole_shape(name), .fill(name, local, region)
    InitWeights(record, device)  the factory's own initialization, replayed at a shard
    materialize(model, source, device, hand=None) -> Materialized
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from autopar.runtime.collectives import local_shard
from autopar.runtime.startup.record import Const, InitRecord, InitRecordError
from autopar.runtime.startup.regions import HandSlice, Region, region_of
from autopar.runtime.startup.replay import Evaluator
from autopar.tracing import is_lifted_constant

# elements evaluated at once: the replay's temporaries are a few int64 and float64 tensors of
# this many entries (about 16 MB at 2**18), whatever the tensor's size
BLOCK_ELEMENTS = 2**18


class WeightSource(Protocol):
    def whole_shape(self, name: str) -> tuple[int, ...]: ...

    def fill(self, name: str, local: torch.Tensor, region: Region) -> None: ...


class InitWeights:
    """The model factory's initialization (`record.record_build`), replayed at the elements
    of each shard on ``device`` (`replay.Evaluator`), block by block."""

    def __init__(self, record: InitRecord, device: torch.device | str = "cpu") -> None:
        self.record = record
        self.evaluator = Evaluator(device)

    def whole_shape(self, name: str) -> tuple[int, ...]:
        source = self.record.source(name)
        if isinstance(source, Const):
            return tuple(source.tensor.shape)
        return source.layout.size

    def fill(self, name: str, local: torch.Tensor, region: Region) -> None:
        source = self.record.source(name)
        flat = local.view(-1) if local.is_contiguous() else torch.empty_like(local).view(-1)
        device = self.evaluator.device
        for start in range(0, region.numel, BLOCK_ELEMENTS):
            stop = min(region.numel, start + BLOCK_ELEMENTS)
            coords = region.coords(start, stop, device)
            values = self.evaluator.values(source, coords) if coords else None
            if values is None:  # a 0-dim tensor
                values = self.evaluator.values(source, ()).reshape(1)
            flat[start:stop].copy_(values)
        if not local.is_contiguous():
            local.copy_(flat.view(local.shape))
        self.evaluator.clear()  # a whole tensor a fallback made is this tensor's only


_CALL_SUFFIX = re.compile(r"@\d+(?=\.|$)")  # torch.export's name for a module's n-th call


def _lifted_constants(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """{name: value} of the buffers the factory did not make: constants torch.export lifted
    into a traced pipeline chunk (`traced_stages`), whose values the trace knows (a window
    size the model's code made a tensor of; an empty placeholder). One made from a meta
    tensor has none to give: InitRecordError names it (the planner offers no traced pipeline
    to such a model: `capability`)."""
    out = {}
    for name, tensor in model.named_buffers(remove_duplicate=False):
        if not is_lifted_constant(name):
            continue
        if tensor.is_meta and tensor.numel():
            raise InitRecordError(
                f"{name}: a constant of {type(model).__name__}'s traced graph that its code "
                "made from a tensor on the meta device, so no value: cut this model by a "
                "ModelParts entry (autopar.runtime.parts), or run it without pipeline stages"
            )
        out[name] = None if tensor.is_meta else tensor.detach().clone()  # None: empty
    return out


@dataclass(frozen=True)
class Materialized:
    """What `materialize` filled: tensors and their elements on this rank."""

    num_tensors: int
    num_elements: int


def _to_empty(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device)`` keeping each parameter one object: swapped in place
    (`torch.utils.swap_tensors`), so a parameter two modules share (a tied head) stays shared
    and FSDP2 keeps its references (it asserts as much in this mode). A parameter something
    holds a weak reference to cannot be swapped (a traced pipeline chunk's); then the plain
    `to_empty`, which gives each module a new parameter, and the shared ones tied again."""
    params = list(model.parameters())
    if not any(weakref.getweakrefcount(p) for p in params):
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to_empty(device=device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        return
    slots = [
        (module, key, id(p))
        for module in model.modules()
        for key, p in module._parameters.items()
        if p is not None
    ]
    model.to_empty(device=device)
    first: dict[int, nn.Parameter] = {}
    for module, key, old in slots:
        if old in first:
            module._parameters[key] = first[old]
        else:
            first[old] = module._parameters[key]


def materialize(
    model: nn.Module,
    source: WeightSource,
    device: torch.device | str,
    hand: Mapping[str, Sequence[HandSlice]] | None = None,
) -> Materialized:
    """Allocate ``model``'s shards on ``device`` and fill them from ``source`` (module
    docstring), in place.

    Raises:
        InitRecordError / ValueError: a parameter the source does not know, or whose shard
            does not fit its placements.
    """
    hand = hand or {}
    lifted = _lifted_constants(model)
    _to_empty(model, device)
    count = elements = 0
    with torch.no_grad():
        # buffers under every name: to_empty gives each module's slot a tensor of its own
        named = [*model.named_parameters(), *model.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            local = local_shard(tensor)
            if name in lifted:
                if lifted[name] is not None:
                    local.copy_(lifted[name])
                continue
            # a traced chunk names a module's second call "rotary_emb@1": the same tensors
            name = _CALL_SUFFIX.sub("", name)
            region = region_of(tensor, source.whole_shape(name), hand.get(name, ()))
            source.fill(name, local, region)
            count += 1
            elements += local.numel()
    return Materialized(count, elements)
