"""Data parallelism by ZeRO stage: replicated (explicit gradient all-reduce), FSDP2, HSDP.

In: a model (possibly already tensor-parallel: DTensor parameters on the "tp" axis), its
repeated blocks, the `RuntimeMesh` and the plan's config. Out: the model with data-parallel
state, and a `DataParallel` record the trainer calls around backward.

    dp > 1, fsdp == 1     replicated: after the last micro-batch's backward every gradient is
                          all-reduced (averaged) over the "dp" group in one flat buffer per
                          dtype (`DataParallel.sync_gradients`), an explicit, visible call.
    fsdp > 1              FSDP2 `fully_shard` per block, then the root, on the "fsdp" axis;
                          with dp > 1 too on the 2-D ("dp", "fsdp") mesh: HSDP (replicate
                          over dp, shard over fsdp). TP parameters become 2-D DTensors.

ZeRO stage -> FSDP2 settings:
    3: reshard_after_forward=True: parameters are all-gathered for forward, freed, and
       all-gathered again for backward (ZeRO-3 / FSDP FULL_SHARD).
    2: reshard_after_forward=False: the gathered parameters stay from forward to backward;
       gradients are reduce-scattered after every micro-batch and optimizer state is sharded.
    1: as 2, but gradients are only reduce-scattered after the last micro-batch (the others
       accumulate full, unsharded gradients: `set_requires_gradient_sync(False)`).
How this differs from ZeRO-1/2 proper (DeepSpeed): there every rank keeps a full copy of the
parameters between steps and all-gathers the updated shards after the optimizer step; FSDP2
frees the unsharded parameters after backward and all-gathers them at the next forward. The
communication volume is the same (one all-gather and one reduce-scatter of the parameters
per step); the memory differs only between steps -- the resident parameters are 1/fsdp of
ZeRO-1/2's -- while the peak inside forward/backward, where the full parameters are live, is
ZeRO-1/2's. ZeRO-1 additionally holds full gradients over the accumulation, as DeepSpeed's.

Public functions:
    apply_data_parallel(model, blocks, mesh, config, experts=None) -> DataParallel
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from autopar.config import ParallelConfig
from autopar.runtime.collectives import all_reduce_flat
from autopar.runtime.mesh import RuntimeMesh

if TYPE_CHECKING:
    from autopar.runtime.expert_parallel import ExpertParallel


@dataclass
class DataParallel:
    """What the trainer does around backward for the plan's data-parallel axes."""

    kind: str  # "none", "replicate", "fsdp", "hsdp"
    zero_stage: int
    model: nn.Module
    group: dist.ProcessGroup | None = None  # the dp group for "replicate"
    size: int = 1
    sharded_modules: list[str] = field(default_factory=list)
    # parameters left out of the replicated average: expert parallelism's experts, which each
    # rank holds its own of (`autopar.runtime.expert_parallel` syncs them)
    skip: frozenset[str] = frozenset()

    def before_backward(self, is_last_microbatch: bool) -> None:
        """ZeRO-1: reduce-scatter gradients only on the last micro-batch."""
        if self.kind in ("fsdp", "hsdp") and self.zero_stage == 1:
            self.model.set_requires_gradient_sync(is_last_microbatch)

    def sync_gradients(self) -> None:
        """Replicated data parallelism: average every gradient over the dp group, flattened
        into one buffer per dtype (one all-reduce each), as DDP's buckets do."""
        if self.kind != "replicate":
            return
        grads = [
            _local(p.grad)
            for name, p in self.model.named_parameters()
            if p.grad is not None and name not in self.skip
        ]
        all_reduce_flat(grads, self.group, divide_by=self.size)

    def as_text(self) -> str:
        if self.kind == "replicate":
            return (
                f"replicated over dp={self.size}: gradients all-reduced after the last micro-batch"
            )
        if self.kind in ("fsdp", "hsdp"):
            reshard = (
                "reshard after forward" if self.zero_stage == 3 else "keep gathered to backward"
            )
            return (
                f"{self.kind.upper()} (FSDP2 fully_shard, ZeRO-{self.zero_stage}, {reshard}) on "
                f"{len(self.sharded_modules)} modules"
            )
        return "no data parallelism"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def apply_data_parallel(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    mesh: RuntimeMesh,
    config: ParallelConfig,
    experts: ExpertParallel | None = None,
) -> DataParallel:
    """Shard or replicate ``model`` over the mesh's data axes (in place).

    Args:
        model: the model (after tensor parallelism and recompute wrapping).
        blocks: (path, module) of the repeated blocks, each its own FSDP unit.
        mesh: the plan's mesh.
        config: dp, fsdp, zero_stage.
        experts: expert parallelism's record: with fsdp its expert modules become FSDP2
            units of their own first (`ExpertParallel.shard`), or are left out of FSDP.
    """
    if config.fsdp > 1:
        axes = ("dp", "fsdp") if config.dp > 1 else ("fsdp",)
        data_mesh = mesh[axes]
        reshard = config.zero_stage == 3
        ignored = experts.shard(reshard) if experts is not None else set()
        names = []
        for path, block in blocks:
            fully_shard(
                block, mesh=data_mesh, reshard_after_forward=reshard, ignored_params=ignored
            )
            names.append(path)
        # the root holds the rest (embeddings, final norm, head); the last unit's parameters
        # are needed again at once by backward, so it never reshards after forward
        fully_shard(model, mesh=data_mesh, reshard_after_forward=False, ignored_params=ignored)
        names.append("<root>")
        kind = "hsdp" if config.dp > 1 else "fsdp"
        return DataParallel(kind, config.zero_stage, model, None, config.fsdp, names)
    if config.dp > 1:
        return DataParallel("replicate", 0, model, mesh.group("dp"), config.dp)
    return DataParallel("none", 0, model)
