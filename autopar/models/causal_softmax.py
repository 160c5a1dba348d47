"""Megatron-LM's fused causal softmax as one op, so that a trace sees what Megatron runs.

Before FlashAttention, Megatron-LM (2020-2022, and Aceso's runtime built on it) computed
attention step by step, but not op by op as eager PyTorch does: the score GEMM takes the
1/sqrt(d) scale as its alpha (`torch.baddbmm`), and one CUDA kernel masks the future keys and
takes the softmax (`FusedScaleMaskSoftmax`, `scaled_upper_triang_masked_softmax`, on by default
with `masked_softmax_fusion`). Eager PyTorch scales, masks and normalises the s x s scores in
three passes; the kernel reads them once and writes the probabilities once, and keeps only the
probabilities for its backward. `causal_softmax` is that kernel's contract as a custom op:
traced as one memory-bound op of its input and output, run here by the eager ops (no CUDA
kernel of ours: `torch.library` gives the op its fake and autograd rules, the backward is
torch's own softmax backward on the kept probabilities).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("autopar::causal_softmax", mutates_args=())
def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of ``scores`` [..., S_q, S_k], each query's later keys masked."""
    s_q, s_k = scores.shape[-2], scores.shape[-1]
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


@causal_softmax.register_fake
def _(scores: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scores)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (probs,) = ctx.saved_tensors
    return torch._softmax_backward_data(grad, probs, -1, probs.dtype)


causal_softmax.register_autograd(_backward, setup_context=_setup_context)
