"""Per-op measurements on meta tensors: FLOPs, backward FLOPs, tensors saved for backward.

In: an aten op and its arguments as the exported graph recorded them (fake tensors), plus which
tensor arguments require grad. Out: an `OpProfile`.

How: the op is run once on meta tensors of the same shapes, strides and dtypes, under torch's
`FlopCounterMode` (its FLOP registry) and autograd's `saved_tensors_hooks`; then autograd runs
its backward, still under the counter. Every saved tensor is matched to an argument or output by
storage identity; the rest are the op's internal saved tensors. Results are cached per
(op, argument signature), so the 80 equal layers of a Llama 70B cost one probe per distinct op.

Op knowledge that meta execution cannot give lives in the registries below: the op class for the
compute model, and the saved tensors of fused attention (on meta, scaled_dot_product_attention
takes the math path and would save the s^2 score matrix, which flash kernels never store).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from autopar.tracing.graph import OpClass

_MATMUL = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum", "_grouped_mm", "addbmm",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "_scaled_mm", "grouped_mm_fallback",
    "grouped_mm_fallback_backward",
}  # fmt: skip
_ATTENTION = {
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "flex_attention",
}  # fmt: skip
_REDUCTION = {
    "sum", "mean", "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm",
    "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
    "batch_norm", "_native_batch_norm_legit_functional", "var", "var_mean", "amax", "amin",
    "max", "min", "cumsum", "topk", "sort", "argmax", "argmin", "norm", "linalg_vector_norm",
    "nll_loss_forward", "cross_entropy_loss", "logsumexp", "histc",
}  # fmt: skip


def _grouped_mm_flops(a_shape, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: each row of the ragged operand meets one
    group's matrix, so the count is the dense product's over the rows actually present, not
    over every group (torch's FLOP registry has no formula for the op; without one the
    experts of a grouped-GEMM MoE count zero).

        a [T, K],    b [G, K, N]  (offs splits T over G)   2 T K N   (the experts' forward)
        a [G, M, K], b [G, K, N]                            2 G M K N
        a [K, T],    b [T, N]     (offs splits T)           2 K T N   (the weight gradient)
        a [G, M, K], b [K, T]     (offs splits T)           2 M K T
    """
    k = a_shape[-1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * k * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * k * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * k * b_shape[1]
    return 2 * a_shape[1] * k * b_shape[-1]


def _register_grouped_mm() -> None:
    """Give torch's FLOP counter the grouped GEMMs it lacks: ``aten._grouped_mm`` and
    transformers' ``grouped_mm_fallback`` (the same contract; the custom op its grouped_mm
    experts call where ``_grouped_mm`` does not dispatch, as on the CPU and meta device). The
    custom op exists once transformers' MoE integration is imported (the model is built before
    it is traced), so this runs when a prober starts."""
    formulas = (
        ("aten", "_grouped_mm", _grouped_mm_flops),
        ("transformers", "grouped_mm_fallback", _grouped_mm_flops),
        ("transformers", "grouped_mm_fallback_backward", _grouped_mm_backward_flops),
    )
    for namespace, name, formula in formulas:
        space = getattr(torch.ops, namespace) if hasattr(torch.ops, namespace) else None
        packet = getattr(space, name, None) if space is not None else None
        if packet is not None and packet not in flop_registry:
            register_flop_formula(packet)(formula)


def _grouped_mm_backward_flops(a_shape, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    """transformers' ``grouped_mm_fallback_backward(input, weight, offs, grad_output)``: the
    input gradient and the weight gradient, each the forward's FLOPs."""
    return 2 * _grouped_mm_flops(a_shape, b_shape)


def op_class_of(op_name: str, is_view: bool, floating_output: bool) -> OpClass:
    """Class of an op for the compute model, from its packet name ("aten.mm" -> "mm")."""
    # "aten.mm.default" -> "mm"; a custom op "transformers.grouped_mm_fallback.default" too
    base = op_name.split(".")[1] if op_name.count(".") >= 2 else op_name
    if is_view:
        return "view"
    if base in _MATMUL:
        return "matmul"
    if base in _ATTENTION:
        return "attention"
    if base in _REDUCTION:
        return "reduction"
    return "elementwise" if floating_output else "other"


@dataclass(frozen=True)
class OpProfile:
    flops: float
    backward_flops: float
    saved_args: tuple[int, ...]  # indices (into the flattened tensor args) saved for backward
    saved_outputs: tuple[int, ...]  # indices of outputs saved for backward
    saved_internal_bytes: int  # saved tensors that are neither an argument nor an output
    probed: bool  # False when the op could not run on meta (nothing measured)


def _attention_internal_bytes(args: list[torch.Tensor]) -> int:
    # Flash-style kernels keep only the fp32 log-sum-exp per query row and head (Dao 2023).
    q = args[0]
    return 4 * math.prod(q.shape[:-1])


# What an op keeps for its backward where meta's run of it says otherwise: (indices of the
# flattened arguments, of the outputs, internal bytes). Fused attention's backward reads the
# query, key, value and output beside the log-sum-exp (Dao 2023, Alg. 2; torch's flash,
# efficient and cuDNN kernels and the CPU flash kernel save exactly those). The math path meta
# runs saves scaled copies of q and k and the s^2 score matrix instead, all internal, so
# without this rule q and k would not be counted (v only in fp32). The output is not counted
# here: fused kernels write it heads-inner ([b, s, heads, d], returned transposed), so the
# transpose-and-reshape before the output projection is a view of it, and that projection
# saves its input; on meta the reshape copies, and counting both would count it twice.
_SAVED_RULES = {"scaled_dot_product_attention": ((0, 1, 2), (), _attention_internal_bytes)}


class OpProber:
    """Runs ops on meta tensors and caches what it measured (one prober per trace)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], OpProfile] = {}
        self.failures: dict[str, str] = {}  # op name -> first error seen
        _register_grouped_mm()

    def profile(self, target: Any, args: tuple, kwargs: dict, grad_mask: list[bool]) -> OpProfile:
        """Measure one call; ``grad_mask[i]`` says whether flattened tensor arg i needs grad."""
        key = (target, _signature(args), _signature(kwargs), tuple(grad_mask))
        cached = self._cache.get(key)
        if cached is None:
            cached = self._measure(target, args, kwargs, grad_mask)
            self._cache[key] = cached
        return cached

    def _measure(self, target: Any, args: tuple, kwargs: dict, grad_mask: list[bool]) -> OpProfile:
        tensors: list[torch.Tensor] = []

        def to_meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                i = len(tensors)
                if i < len(grad_mask) and grad_mask[i] and t.dtype.is_floating_point:
                    t.requires_grad_(True)
                tensors.append(t)
                return t
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x

        meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        try:
            with FlopCounterMode(display=False) as counter:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = target(*meta_args, **meta_kwargs)
                forward = counter.get_total_flops()
                outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
                _run_backward(outputs, tensors)
                backward = counter.get_total_flops() - forward
        except Exception as e:  # an op meta cannot run: record it, measure nothing
            self.failures.setdefault(str(target), f"{type(e).__name__}: {e}"[:300])
            return OpProfile(0.0, 0.0, (), (), 0, probed=False)
        share = _causal_share(target, meta_args, meta_kwargs)
        forward, backward = forward * share, backward * share
        return _classify_saved(str(target), saved, tensors, outputs, forward, backward)


def _causal_share(target: Any, args: tuple, kwargs: dict) -> float:
    """The share of the score matrix a call with ``is_causal`` computes (`causal_share`); 1
    for any other call or op.

    torch's FLOP counter prices scaled_dot_product_attention as the whole L x S score matrix
    (meta runs the math path), but with ``is_causal`` the fused kernels (flash, cuDNN, the CPU
    flash kernel) skip the blocks above the diagonal: about half the work at L = S. Counted
    whole, a 32k-token Llama 3.1 8B layer's attention priced 2x its FLOPs. A call handed a
    mask tensor is counted whole here (kernels given a mask compute every block); a Hugging
    Face model's causal mask, made only because it is exported, is `tracing.causal_calls`'.
    """
    schema = getattr(target, "_schema", None)
    if schema is None or op_class_of(str(target), False, True) != "attention":
        return 1.0
    names = [a.name for a in schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not bound.get("is_causal") or "query" not in bound or "key" not in bound:
        return 1.0
    return causal_share(bound["query"].shape[-2], bound["key"].shape[-2])


def causal_share(rows: int, cols: int) -> float:
    """The share of an L x S score matrix under torch's causal mask, which is top-left aligned
    (row i sees keys 0..i): sum_i min(i + 1, S) / (L S)."""
    if not rows or not cols:
        return 1.0
    full = min(rows, cols)  # rows 0..full-1 see 1..full keys; any row past S sees all S
    seen = full * (full + 1) / 2 + (rows - full) * cols
    return seen / (rows * cols)


def _classify_saved(
    name: str,
    saved: list[torch.Tensor],
    args: list[torch.Tensor],
    outputs: list[torch.Tensor],
    forward: float,
    backward: float,
) -> OpProfile:
    arg_of = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(args)}
    out_of = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(outputs)}
    saved_args, saved_outs, internal, seen = set(), set(), 0, set()
    for t in saved:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in arg_of:
            saved_args.add(arg_of[ref])
        elif ref in out_of:
            saved_outs.add(out_of[ref])
        elif ref not in seen:
            seen.add(ref)
            internal += t.numel() * t.element_size()
    rule = _SAVED_RULES.get(name.split(".")[1] if name.startswith("aten.") else name)
    if rule is not None:
        kept_args, kept_outs, internal_of = rule
        saved_args, saved_outs, internal = set(kept_args), set(kept_outs), internal_of(args)
    return OpProfile(
        forward, backward, tuple(sorted(saved_args)), tuple(sorted(saved_outs)), internal, True
    )


def _run_backward(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    diff_out = [o for o in outputs if o.requires_grad and o.grad_fn is not None]
    diff_in = [t for t in inputs if t.requires_grad]
    if not diff_out or not diff_in:
        return
    torch.autograd.grad(
        diff_out, diff_in, [torch.empty_like(o) for o in diff_out], allow_unused=True
    )


def _signature(tree: Any) -> tuple[Any, ...]:
    leaves, spec = tree_flatten(tree)
    sig: list[Any] = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), tuple(x.stride()), x.dtype))
        else:
            sig.append(repr(x))
    return tuple(sig)
