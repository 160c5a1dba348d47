"""Activation recomputation per block with torch's checkpoint APIs.

In: the repeated blocks and the plan's policy. Out: the blocks, each forward now running under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`; parameter names are unchanged (the
block's `forward` is wrapped in place rather than the module replaced, so plans, optimizer
state and checkpoints keep their keys).

    none       nothing is wrapped
    full       a block keeps only its input; backward re-runs its whole forward
    selective  a block keeps the outputs of its matmuls and attention (and of the collectives
               TP issues) and recomputes the cheap elementwise ops, norms and activations
               in between (Korthikanti et al. 2022's selective recomputation, by torch's
               `create_selective_checkpoint_contexts`)

Apply after tensor parallelism and before FSDP (as torchtitan): FSDP's hooks then sit outside
the checkpointed region and the recomputed forward reads the already gathered parameters.

Public functions:
    apply_recompute(blocks, policy) -> number of blocks wrapped
    selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten
# Ops whose outputs selective recomputation keeps: the expensive ones (matmuls, attention)
# and the collectives, which would otherwise be issued again in backward.
SAVED_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_reduce.default,
    }
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul, attention and collective outputs; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(blocks: list[tuple[str, nn.Module]], policy: str) -> int:
    """Wrap each block's forward for ``policy`` ("none", "full", "selective"), in place.

    Returns the number of blocks wrapped. Raises ValueError for another policy.
    """
    if policy == "none":
        return 0
    if policy not in ("full", "selective"):
        raise ValueError(f"recompute must be none, full or selective, got {policy!r}")
    for _, block in blocks:
        block.forward = _checkpointed(block.forward, policy)  # instance attribute: nn.Module
    return len(blocks)


def _checkpointed(forward: Callable[..., Any], policy: str) -> Callable[..., Any]:
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, selective_policy)
        if policy == "selective"
        else None
    )

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run
