"""Tensor parallelism applied: a TP plan's styles as torch ParallelStyles on the tp mesh, the
loss context of a vocabulary-split head, and the gradient sums sequence parallelism leaves.

In: a model and a TP plan (`autopar.runtime.tensor_parallel.tp_plan`: module path -> style;
that module documents the styles and their collectives). Out: the model with its planned
parameters as DTensors (`apply_tensor_parallel`), and after each backward its gradients
made whole (`reduce_partial_grads`).

Public functions:
    apply_tensor_parallel(model, tp_mesh, plan) -> model   # re-ties a tied head
    loss_context(plan) -> context manager                   # loss_parallel() for a vocab head
    reduce_partial_grads(model) -> int  # SP: norm grads Partial -> Replicate, token_sum summed
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard  # no public name (2.13)

from autopar.runtime.collectives import all_reduce_flat
from autopar.runtime.fused_pieces import Pieces
from autopar.runtime.low_precision import run_mxfp8_locally
from autopar.runtime.tensor_parallel import STYLES, transposed


def _style(style: str) -> ParallelStyle:
    name, _, count = style.partition("/")
    rest = (None,) * (int(count or 1) - 1)
    if name == "colwise":  # "/N": a fused projection of N pieces
        return _Colwise(int(count or 1))
    if name == "rowwise":
        return _Rowwise()
    if name == "colwise_gather":
        return _Colwise(int(count or 1), output_layouts=Replicate())
    if name == "rowwise_from_replicate":
        return _Rowwise(input_layouts=Replicate())
    if name == "rowwise_to_seq":
        return _Rowwise(output_layouts=Shard(1))
    if name == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    if name == "head_norm":  # [batch, seq, heads, head_dim]: the rank's heads on dim 2
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == "token_sum":
        return _SummedOverTp()
    if name == "expert_split":  # sliced later (`expert_tensor_parallel`), after ep's dispatch
        return _Unchanged()
    if name == "latent_kv":
        return _SharedTailGrad(int(count))
    if name == "replicate_in":
        return _FirstInput(Replicate(), Replicate(), local=False)
    if name == "gather_seq":  # a DTensor, so q/k/v's partial input grads sum before one RS
        return _FirstInput(Shard(1), Replicate(), local=False)
    if name == "gather_seq_local":
        return _FirstInput(Shard(1), Replicate(), local=True)
    if name == "shard_seq":
        return _FirstInput(Replicate(), Shard(1), local=True)
    if name == "gather_out":
        return PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
    if name == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "vocab_embedding_seq":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if name == "vocab_head":
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if name == "vocab_head_seq":
        return ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    if name == "shard_seq_gather_out":
        return PrepareModuleInputOutput(
            input_layouts=(Replicate(), *rest),
            desired_input_layouts=(Shard(1), *rest),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=Replicate(),
        )
    raise ValueError(f"unknown tensor-parallel style {style!r}; known: {', '.join(STYLES)}")


class _Colwise(ColwiseParallel):
    """torch's ColwiseParallel, also for a `transposed` linear (its weight split on dim 1) and a
    fused projection of ``pieces`` (`autopar.runtime.fused_pieces`): each piece split over tp
    (`_StridedShard`), the local output handed on as `Pieces`, whose cuts at the whole
    output's offsets are taken at the rank's."""

    def __init__(self, pieces: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pieces = pieces

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.pieces == 1 and not transposed(module):
            return super()._apply(module, device_mesh)
        out_dim = 1 if transposed(module) else 0

        def split(name: str) -> Placement:
            dim = out_dim if name == "weight" else 0  # the bias: its only dimension
            return _StridedShard(dim, split_factor=self.pieces) if self.pieces > 1 else Shard(dim)

        output = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        if self.pieces > 1 and self.output_layouts == (Shard(-1),) and self.use_local_output:
            # torch's would redistribute the strided split to a plain one: hand on the local
            # [piece 0's share | piece 1's share | ...] as it is
            ways, piece = device_mesh.size(), module.weight.shape[out_dim] // self.pieces

            def output(_: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> Pieces:
                return Pieces.wrap(outputs.to_local(), ways, piece)

        return distribute_module(
            module,
            device_mesh,
            _partition(split, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            output,
        )


class _Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, also for a `transposed` linear: its weight split on dim 0, its
    bias replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not transposed(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)

        def split(name: str) -> Placement:
            return Shard(0) if name == "weight" else Replicate()

        return distribute_module(
            module,
            device_mesh,
            _partition(split, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _partition(split: Any, src_data_rank: int | None) -> Any:
    """distribute_module's partition function: each of a module's own parameters a DTensor of
    the placement ``split(name)`` gives it."""

    def partition(_: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            whole = distribute_tensor(param, mesh, [split(name)], src_data_rank=src_data_rank)
            module.register_parameter(name, nn.Parameter(whole, param.requires_grad))

    return partition


class _FirstInput(ParallelStyle):
    """A module's first input -- positional, or the keyword of forward's first parameter
    (Hugging Face attention is called as ``self_attn(hidden_states=...)``) -- made a DTensor
    of ``given`` placement and redistributed to ``wanted``; other inputs pass unchanged.
    torch's PrepareModuleInput needs to know beforehand whether inputs come positionally or
    by keyword; this does not."""

    def __init__(self, given: Placement, wanted: Placement, *, local: bool) -> None:
        super().__init__()
        self.given, self.wanted, self.local = given, wanted, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def convert(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.given,), run_check=False)
            if x.placements != (self.wanted,):
                x = x.redistribute(device_mesh, (self.wanted,))
            return x.to_local() if self.local else x

        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: convert(kwargs[first])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _SummedOverTp(ParallelStyle):
    """Leaves the module as it is (plain parameters, local inputs) and marks it: after the
    backward `reduce_partial_grads` sums its parameters' gradients over the tp group.
    Plain tensors rather than replicated DTensors, because expert stacks run custom ops
    (grouped_mm, index_add, the expert-parallel all-to-all) DTensor has no rules for."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # every submodule: expert parallelism later swaps the zoo's expert list for a dict of
        # this rank's experts, the same modules
        for sub in module.modules():
            sub._autopar_token_sum = device_mesh.get_group()  # type: ignore[assignment]
        return module


class _Unchanged(ParallelStyle):
    """Leaves the module as it is: a part another module splits over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class _SharedTailGrad(ParallelStyle):
    """A replicated module whose last ``width`` outputs every tp rank reads for its own heads
    (MLA's rotary key): the gradient of that slice is all-reduced over tp in the backward
    (Megatron's f on the slice), the rest of its gradient is already whole."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, width = device_mesh.get_group(), self.width

        def hook(_: nn.Module, __: tuple, out: torch.Tensor) -> torch.Tensor:
            return _SumTailGrad.apply(out, width, group)

        module.register_forward_hook(hook)
        return module


class _SumTailGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        tail = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., : -ctx.width], tail], dim=-1), None, None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> nn.Module:
    """Turn ``model``'s planned modules into DTensor modules on the 1-D ``tp_mesh`` (in place).

    Module paths are applied in plan order; an empty plan leaves the model as it is. A
    planned module's parameter that another module holds too (a head tied to its embedding,
    both Shard(0) over the vocabulary; a bias a head also keeps as its own attribute) is
    shared again afterwards: parallelize_module replaces each module's parameter on its own,
    which would untie them.
    """
    if not plan:
        return model
    tied = _tied_parameters(model, plan)
    parallelize_module(model, tp_mesh, {path: _style(s) for path, s in plan.items()})
    for (owner, name), (user, user_name) in tied:
        setattr(model.get_submodule(user), user_name, getattr(model.get_submodule(owner), name))
    for path, style in plan.items():  # after re-tying: the parameter the model keeps
        if style.startswith("vocab_embedding"):
            model.get_submodule(path).weight.register_post_accumulate_grad_hook(_keep_rows)
    for path in plan:  # MXFP8 linears compute on their shards (`run_mxfp8_locally`)
        run_mxfp8_locally(model.get_submodule(path))
    return model


def _keep_rows(p: nn.Parameter) -> None:
    """A vocabulary-split embedding's gradient cut to this rank's rows as soon as it is
    accumulated. DTensor's embedding backward gives the whole vocabulary's gradient on every tp
    rank (a Replicate weight gradient from the replicated output gradient); kept until the
    step, it held tp times the planned gradient bytes over every later micro-batch's
    activations (a full-vocabulary fp32 table per rank: 3.7 GB more for Llama 3 70B at tp=8).
    Replicate -> Shard is a local slice into a new tensor, and the micro-batches after the
    first add into the rows in place."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _tied_parameters(
    model: nn.Module, plan: dict[str, str]
) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """((owner module, name), (holder module, name)) for each planned module's parameter that
    another module also holds: a head tied to its embedding, or BERT's decoder bias, which is
    also its prediction head's own `bias`."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((path, name))
    done: set[int] = set()
    out = []
    for path in plan:
        for name, p in model.get_submodule(path).named_parameters(recurse=False):
            if id(p) in done:
                continue
            done.add(id(p))
            out += [((path, name), other) for other in holders[id(p)] if other != (path, name)]
    return out


def loss_context(plan: dict[str, str]) -> Any:
    """The context the loss and its backward run in: torch's `loss_parallel()` when the plan
    leaves the logits sharded over the vocabulary, otherwise a no-op."""
    if any(style.startswith("vocab_head") for style in plan.values()):
        return loss_parallel()
    return contextlib.nullcontext()


def reduce_partial_grads(model: nn.Module) -> int:
    """All-reduce the gradients DTensor left as partial sums (a sequence-parallel norm's weight
    sees only its sequence shard) into replicated ones, and give every gradient its
    parameter's placements; sum the gradients of "token_sum" modules (routers and experts on
    sequence shards) over tp; returns how many partial gradients there were.

    Gradients with the same mesh and placements go in one flat all-reduce (as Megatron
    all-reduces its sequence-parallel layer-norm gradients coalesced), so a step issues one
    call per such group, not one per parameter, and one for the token_sum modules: the
    counts `Plan.communication` predicts."""
    _sum_token_modules(model)
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((id(g.device_mesh), tuple(g.placements)), []).append(p)
    for params in groups.values():
        first = params[0].grad
        assert isinstance(first, DTensor)
        mesh, placements = first.device_mesh, first.placements
        locals_ = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if pl.is_partial():  # Partial("sum"): DTensor's gradient partials are sums
                dist.all_reduce(flat, group=mesh.get_group(dim))
        replicated = [Replicate() if pl.is_partial() else pl for pl in placements]
        offset = 0
        for p, t in zip(params, locals_, strict=True):
            local = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(
                local, mesh, replicated, run_check=False, shape=p.shape, stride=p.stride()
            )
    for p in model.parameters():  # a gradient `_keep_rows` did not see cut (none expected)
        _keep_rows(p)
    return sum(len(ps) for ps in groups.values())


def _sum_token_modules(model: nn.Module) -> None:
    """A flat all-reduce (`all_reduce_flat`) over tp of the gradients of the modules
    `_SummedOverTp` marked (their local shards where FSDP shards them): each tp rank's
    gradient is its sequence shard's share. An expert no token of this rank's shard reached
    has no gradient: zeros, so every tp rank reduces the same tensors."""
    grads: list[torch.Tensor] = []
    group = None
    for module in model.modules():
        if (mark := getattr(module, "_autopar_token_sum", None)) is None:
            continue
        group = mark
        for p in module.parameters(recurse=False):
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                grads.append(_local_grad(p))
    if grads:
        all_reduce_flat(grads, group)


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g  # type: ignore[return-value]
