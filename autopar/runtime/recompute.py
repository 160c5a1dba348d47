"""Activation recomputation per block with torch's checkpoint APIs.

In: the repeated blocks (of the model, or of one pipeline chunk), the plan's policy and its
recompute_layers k. Out: the first k blocks (all when k is None), each forward now running under
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

Per-layer recompute wraps the first k blocks in the order given (the model's, or the chunk's);
the rest keep their activations, as the estimator prices it (`autopar.estimate.step`).

Public functions:
    apply_recompute(blocks, policy, num_layers=None) -> number of blocks wrapped
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


def apply_recompute(
    blocks: list[tuple[str, nn.Module]], policy: str, num_layers: int | None = None
) -> int:
    """Wrap the forward of the first ``num_layers`` blocks (every block when None) for
    ``policy`` ("none", "full", "selective"), in place.

    Returns the number of blocks wrapped (fewer than ``num_layers`` when there are fewer
    blocks: a pipeline chunk of an uneven split). Raises ValueError for another policy or a
    ``num_layers`` below 1.
    """
    if policy == "none":
        return 0
    if policy not in ("full", "selective"):
        raise ValueError(f"recompute must be none, full or selective, got {policy!r}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"recompute_layers must be None or >= 1, got {num_layers}")
    chosen = blocks if num_layers is None else blocks[:num_layers]
    for _, block in chosen:
        block.forward = _checkpointed(block.forward, policy)  # instance attribute: nn.Module
    return len(chosen)


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
