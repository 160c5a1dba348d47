"""Data parallelism by ZeRO stage: replicated (explicit gradient all-reduce), FSDP2, HSDP.

In: a model (possibly already tensor-parallel: DTensor parameters on the "tp" axis), its
repeated blocks, the `RuntimeMesh` and the plan's config. Out: the model with data-parallel
state, and a `DataParallel` record the trainer calls around backward.

    dp > 1, fsdp == 1     replicated: after the last micro-batch's backward every gradient is
                          all-reduced (averaged) over the "dp" group in one flat buffer per
                          dtype (`DataParallel.sync_gradients`), an explicit, visible call.
    fsdp > 1              FSDP2 `fully_shard` per block, on the token embedding and on the
                          LM head (`end_units`), then the root, on the "fsdp" axis;
                          with dp > 1 too on the 2-D ("dp", "fsdp") mesh: HSDP (replicate
                          over dp, shard over fsdp). TP parameters become 2-D DTensors.

Mixed precision: training in bf16 (or a low-precision recipe, bf16 around its linears) gives
every FSDP2 unit `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, as
torchtitan does: the sharded parameters stay fp32 (the master weights the optimizer steps),
the all-gather moves and the unsharded layer holds bf16 (what the plan prices), and gradients
are reduce-scattered and accumulated in fp32. Without it FSDP2 gathers fp32 parameters --
twice the planned all-gather bytes and gathered memory -- and autocast keeps a bf16 copy of
every gathered weight from forward to backward beside them (found reading this module after
a one-GPU plan ran out of memory on an H100, benchmarks/gpu_program.py; FSDP itself has not
run on a GPU here). Without FSDP, each block's inputs are cast to bf16 as that policy casts
them (`_CastInputs`), and autocast computes over the fp32 parameters; a value several linears
read (a norm's output, fp32 over its fp32 weight) is cast once for all of them
(`_SharedCasts`).

ZeRO stage -> FSDP2 settings:
    3: reshard_after_forward=True: parameters are all-gathered for forward, freed, and
       all-gathered again for backward (ZeRO-3 / FSDP FULL_SHARD).
    2: reshard_after_forward=False: the gathered parameters stay from forward to backward;
       gradients are reduce-scattered after every micro-batch and optimizer state is sharded.
    1: as 2, but gradients are only reduce-scattered after the last micro-batch (the others
       accumulate full, unsharded gradients: `set_requires_gradient_sync(False)`).
    Under a pipeline (pp > 1) the three behave alike: torch's pipelining keeps each chunk's
    gradients unsharded and its parameters gathered from its first backward to the end of the
    step, so the blocks are not resharded after forward either (one gather a step, as
    torchtitan; the plan prices this as `CostOptions.pp_keeps_unsharded`).
How this differs from ZeRO-1/2 proper (DeepSpeed): there every rank keeps a full copy of the
parameters between steps and all-gathers the updated shards after the optimizer step; FSDP2
frees the unsharded parameters after backward and all-gathers them at the next forward. The
communication volume is the same (one all-gather and one reduce-scatter of the parameters
per step); the memory differs only between steps -- the resident parameters are 1/fsdp of
ZeRO-1/2's -- while the peak inside forward/backward, where the full parameters are live, is
ZeRO-1/2's. ZeRO-1 additionally holds full gradients over the accumulation, as DeepSpeed's.

Public functions:
    apply_data_parallel(model, blocks, mesh, config, experts=None, param_dtype=None,
                        ends=(None, None)) -> DataParallel
    end_units(model, blocks) -> (embedding path or None, head path or None)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_map_only

from autopar.config import ParallelConfig
from autopar.runtime.collectives import all_reduce_flat, local_shard
from autopar.runtime.mesh import RuntimeMesh
from autopar.runtime.tensor_parallel import find_vocab_layers
from autopar.tracing.layers import ancestors

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
        """Replicated data parallelism: average every gradient over the dp group, a flat
        buffer in chunks of DDP's bucket size (`all_reduce_flat`)."""
        if self.kind != "replicate":
            return
        grads = [
            local_shard(p.grad)
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


class _CastInputs:
    """A block's floating-point inputs, nested ones too, cast to ``dtype``, as
    `MixedPrecisionPolicy`'s cast_forward_inputs casts an FSDP2 unit's: without FSDP the
    parameters stay fp32 and autocast computes in bf16, but the residual stream (the
    embedding's fp32 output and the sums onto it) would stay fp32, saving fp32 activations
    where an FSDP2 run -- and the plan -- saves bf16 ones."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map_only(torch.Tensor, self._cast, (args, kwargs))


class _SharedCasts:
    """A linear's input cast to ``dtype`` once for every linear that reads it.

    Without FSDP the parameters stay fp32, so a norm's output (its input times its fp32
    weight) is fp32, and autocast casts it to bf16 again for each linear that reads it: q, k
    and v each save a copy, and a dense-dispatch MoE's experts one per expert (an MoE of 4
    experts under TP2 measured 1.05 x the plan, which counts the value once). The first
    linear's cast is kept while the value lives, unchanged (its version), and handed to the
    others: the same bf16 values autocast gave each; their gradients meet in bf16, as under
    FSDP2, whose norms compute over bf16 weights."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.casts: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        x, *rest = args
        if torch.compiler.is_compiling():  # a compiled block: the compiler's graph saves once
            return None
        if not (x.is_floating_point() and x.dtype != self.dtype):
            return None
        if not torch.is_autocast_enabled(x.device.type):
            return None
        key = id(x)
        held = self.casts.get(key)
        if held is not None and held[0]() is x and held[1] == x._version:
            return (held[2], *rest)
        cast = x.to(self.dtype)
        if held is None:
            weakref.finalize(x, self.casts.pop, key, None)
        self.casts[key] = (weakref.ref(x), x._version, cast)
        return (cast, *rest)


def end_units(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> tuple[str | None, str | None]:
    """(token embedding, LM head): the paths of the modules outside the blocks that become
    FSDP2 units of their own, as torchtitan's, None where one stays in the root. In the root
    they would stay gathered from the step's first forward to its last backward (the root's
    pre-forward gathers all its parameters): on a 0.9 B Llama with a 128k vocabulary under
    FSDP8, 2 GB a rank, the difference between training and running out of host memory
    (benchmarks/startup.py). Each must be a layer of its own (its parent holds the blocks, as
    the tracer cuts layers) and the two untied: a tied weight stays in the root, where both
    find it gathered. The plan prices the same units (`estimate.communication.fsdp_end_units`).
    Call it on the whole model: a pipeline chunk holds one of the pair at most."""
    vocab = find_vocab_layers(model, blocks)
    if vocab is None:
        return None, None
    embedding, head, _ = vocab
    if model.get_submodule(embedding).weight is model.get_submodule(head).weight:
        return None, None
    holders = ancestors({path for path, _ in blocks})

    def layer(path: str) -> str | None:
        return path if path.rpartition(".")[0] in holders else None

    return layer(embedding), layer(head)


def apply_data_parallel(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    mesh: RuntimeMesh,
    config: ParallelConfig,
    experts: ExpertParallel | None = None,
    param_dtype: torch.dtype | None = None,
    ends: tuple[str | None, str | None] = (None, None),
) -> DataParallel:
    """Shard or replicate ``model`` over the mesh's data axes (in place).

    Args:
        model: the model (after tensor parallelism and recompute wrapping).
        blocks: (path, module) of the repeated blocks, each its own FSDP unit.
        mesh: the plan's mesh.
        config: dp, fsdp, zero_stage.
        experts: expert parallelism's record: with fsdp its expert modules become FSDP2
            units of their own first (`ExpertParallel.shard`), or are left out of FSDP.
        param_dtype: the dtype FSDP2 gathers and computes in (module docstring: bf16 for
            mixed precision); None keeps the parameters' own (fp32 training).
        ends: `end_units` of the whole model; those ``model`` holds become units of their own.
    """
    if config.fsdp > 1:
        axes = ("dp", "fsdp") if config.dp > 1 else ("fsdp",)
        data_mesh = mesh[axes]
        # under a pipeline, torch's stage keeps an FSDP2 chunk gathered and its gradients
        # unsharded from its first backward to the step's end (PipelineStage.
        # backward_maybe_with_nosync turns reshard-after-backward and gradient sync off), so
        # resharding after each forward would only gather again in every later backward: the
        # blocks stay gathered, as torchtitan's under PP (one gather a step, not two per
        # micro-batch; the peak, all of the chunk gathered, barely moves: 78.8 -> 82.5 MiB on
        # test_memory_peak's pipeline case, the warm-up forwards now holding theirs too)
        reshard = config.zero_stage == 3 and config.pp == 1
        mp = MixedPrecisionPolicy()  # FSDP2's default: the parameters' own dtype throughout
        if param_dtype is not None:
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        ignored = experts.shard(reshard, mp) if experts is not None else set()
        names = []
        for path, block in blocks:
            fully_shard(
                block,
                mesh=data_mesh,
                reshard_after_forward=reshard,
                ignored_params=ignored,
                mp_policy=mp,
            )
            names.append(path)
        # the embedding reshards after forward as a block does; the head, run last, is needed
        # again at once by backward, so it does not
        held = dict(model.named_modules())
        for path, after in zip(ends, (reshard, False), strict=True):
            if path is not None and path in held:
                fully_shard(
                    held[path], mesh=data_mesh, reshard_after_forward=after,
                    ignored_params=ignored, mp_policy=mp,
                )  # fmt: skip
                names.append(path)
        # the root holds the rest (final norm, tied or other embeddings, small parameters);
        # needed again at once by backward, it never reshards after forward
        fully_shard(
            model,
            mesh=data_mesh,
            reshard_after_forward=False,
            ignored_params=ignored,
            mp_policy=mp,
        )
        names.append("<root>")
        kind = "hsdp" if config.dp > 1 else "fsdp"
        return DataParallel(kind, config.zero_stage, model, None, config.fsdp, names)
    if param_dtype is not None:  # as FSDP2's cast_forward_inputs: each block takes bf16
        shared = _SharedCasts(param_dtype)
        for _, block in blocks:
            block.register_forward_pre_hook(_CastInputs(param_dtype), with_kwargs=True)
            for linear in block.modules():
                if isinstance(linear, nn.Linear):
                    linear.register_forward_pre_hook(shared)
    if config.dp > 1:
        return DataParallel("replicate", 0, model, mesh.group("dp"), config.dp)
    return DataParallel("none", 0, model)
