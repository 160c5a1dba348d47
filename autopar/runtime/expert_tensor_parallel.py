"""Expert tensor parallelism (etp = tp): each expert's intermediate width split over the tp ranks.

In: a model whose MoE layers are the zoo's `MoEBlock`s (SwiGLU experts) or Hugging Face expert
stacks (`autopar.runtime.hf_experts`), after expert parallelism kept this rank's experts; the tp
process group; whether sequence parallelism runs. Out: every expert keeps the tp rank's slice
of its intermediate width I -- rows [r I/t, (r+1) I/t) of its gate and of its up projection,
the same columns of its down projection -- under the parameters' own names, and the layer's
expert call (a `MoEBlock.dispatch`, an expert stack's forward) is wrapped as Megatron's MLP
under TP:

    without SP (every tp rank holds the same tokens):
        x, routing weights: identity forward, all-reduce of their gradient backward (f)
        the experts on this rank's slice: a partial sum of each token's output
        out: all-reduce forward (g), identity backward
    with SP (each tp rank holds a sequence shard of T/t tokens):
        x, routing weights (and an expert stack's top-k indices): all-gather forward,
            reduce-scatter of their gradient backward
        out: reduce-scatter forward, all-gather backward

down(act(gate x) * up x) is the sum over the slices of down_r(act(gate_r x) * up_r x), so the
partial outputs add up to the whole expert's (up to the order of the additions). Expert
parallelism's all-to-all runs inside the wrapped call, on every tp rank, with the tokens it
holds after the gather. Each sliced parameter is held by one rank of each tp group: not summed
over tp (`tensor_parallel.tp_plan` gives the experts "expert_split", not "token_sum"), and its
share of the global gradient norm is tp times a replicated one's (`trainer`).

Why by hand: torch's ColwiseParallel/RowwiseParallel take nn.Linear and nn.Embedding only, and
the experts are stacked 3-D parameters (transformers) or run inside a dispatch of data-dependent
row counts that DTensor has no rules for.

Public:
    expert_split_problem(module) -> str        # why an expert stack cannot be split, or ""
    apply_expert_tensor_parallel(model, group, sequence_parallel, required=True)
        -> {name: HandSlice} of the parameters it sliced
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from autopar.runtime.collectives import all_gather_seq, gather_rows, reduce_scatter_seq
from autopar.runtime.expert_parallel import is_moe_block
from autopar.runtime.hf_experts import is_hf_experts
from autopar.runtime.low_precision import wrapped_like
from autopar.runtime.startup.regions import HandSlice


class _CopyToTp(Function):  # Megatron's f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # reduced in place: not autograd's own tensor
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(Function):  # Megatron's g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SplitExperts:
    """An expert call (x [T, H], then the routing: weights, an expert stack's top-k indices,
    a MoEBlock's experts) -> [T, H] on this rank's slices, wrapped with the collectives of the
    module docstring: float tensors (x, the routing weights) with autograd, integer ones (the
    indices) gathered without, anything else passed as it is."""

    def __init__(self, inner, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        self.inner, self.group, self.sp = inner, group, sequence_parallel

    def _in(self, arg):
        if not isinstance(arg, torch.Tensor):
            return arg
        if not arg.is_floating_point():
            return gather_rows(arg, self.group) if self.sp else arg
        return all_gather_seq(arg, self.group, 0) if self.sp else _CopyToTp.apply(arg, self.group)

    def __call__(self, x: torch.Tensor, *args):
        out = self.inner(self._in(x), *(self._in(a) for a in args))
        if self.sp:
            return reduce_scatter_seq(out, self.group, 0)
        return _ReduceFromTp.apply(out, self.group)


def expert_split_problem(module: nn.Module) -> str:
    """Why ``module`` (an `is_hf_experts` stack) cannot be split by its intermediate width:
    "" for the layout Mixtral, Qwen-MoE and DeepSeek-V3 share -- `gate_up_proj` [E, 2I, H]
    (gate rows, then up rows), `down_proj` [E, H, I], no biases."""
    own = dict(module.named_parameters(recurse=False))
    if set(own) != {"gate_up_proj", "down_proj"}:
        extra = sorted(set(own) - {"gate_up_proj", "down_proj"})
        return f"it holds {', '.join(extra)} beside gate_up_proj and down_proj"
    gate_up, down = own["gate_up_proj"], own["down_proj"]
    e, h, i = down.shape
    if tuple(gate_up.shape) != (e, 2 * i, h):
        return (
            f"gate_up_proj {tuple(gate_up.shape)} is not [experts, 2 x {i}, {h}] beside "
            f"down_proj {tuple(down.shape)}"
        )
    return ""


def _slice(param: nn.Parameter, dim: int, pieces: int, rank: int, tp: int) -> nn.Parameter:
    """Rank ``rank``'s 1/tp of each of ``pieces`` equal blocks of ``param`` along ``dim`` (in
    torchao's MXFP8 wrapper again where ``param`` was wrapped: `wrapped_like`)."""
    blocks = param.detach().chunk(pieces, dim=dim)
    mine = wrapped_like(param, torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim))
    return nn.Parameter(mine.clone(), requires_grad=param.requires_grad)


def apply_expert_tensor_parallel(
    model: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool, required: bool = True
) -> dict[str, HandSlice]:
    """Split every expert of ``model`` over the ranks of ``group`` (module docstring), in place;
    returns the parameters now sliced, each with its slice (what a rank's shard of the whole
    tensor is: `autopar.runtime.startup.regions`). ``required``: whether ``model`` must hold
    an MoE layer (False for a pipeline chunk of dense layers).

    Raises:
        ValueError: no MoE layer, an expert stack of another layout (`expert_split_problem`),
            or tp does not divide an expert's intermediate width.
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    names: dict[str, HandSlice] = {}
    for path, module in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        if is_hf_experts(module):
            if why := expert_split_problem(module):
                raise ValueError(f"expert tensor parallelism: {path}: {why}")
            width = module.down_proj.shape[-1]
            if width % tp:
                raise ValueError(f"expert tensor parallelism: tp={tp} does not divide {path}'s "
                                 f"expert width {width}")  # fmt: skip
            for proj, dim, pieces in (("gate_up_proj", 1, 2), ("down_proj", 2, 1)):
                setattr(module, proj, _slice(getattr(module, proj), dim, pieces, rank, tp))
                names[f"{prefix}{proj}"] = HandSlice(dim, pieces, rank, tp)
            module.forward = _SplitExperts(module.forward, group, sequence_parallel)
        elif is_moe_block(module):  # autopar's MoEBlock
            experts = module.experts
            for key, expert in experts.named_children():
                width = expert.down_proj.in_features
                if width % tp:
                    raise ValueError(f"expert tensor parallelism: tp={tp} does not divide "
                                     f"{path}'s expert width {width}")  # fmt: skip
                for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                    linear = getattr(expert, proj)
                    linear.weight = _slice(linear.weight, dim, 1, rank, tp)
                    names[f"{prefix}experts.{key}.{proj}.weight"] = HandSlice(dim, 1, rank, tp)
            # ep = 1: the block's own dense combine (ep's dispatch keeps a dict of its experts)
            combine = module.dispatch or module.dense_combine
            module.dispatch = _SplitExperts(combine, group, sequence_parallel)
    if not names and required:
        raise ValueError(f"expert tensor parallelism: {type(model).__name__} has no MoE layer")
    return names
