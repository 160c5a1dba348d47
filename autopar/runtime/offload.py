"""Activation offloading per block with torch's `save_on_cpu`.

In: the repeated blocks (of the model, or of one pipeline chunk) and the plan's
offload_layers k. Out: the first k blocks' forwards running under
`torch.autograd.graph.save_on_cpu`: every tensor autograd saves for their backward is copied
to host memory (pinned on a GPU) as it is saved and back when the backward reads it. With
recompute the block saves only what the checkpoint keeps (its input under full), and that is
what moves. The block's `forward` is wrapped in place, as recompute's, so parameter names are
unchanged; apply after recompute, so the checkpoint's saved inputs are offloaded too.

The copies run on the compute stream (torch's hooks copy synchronously), as the estimator
prices this runtime (`CostOptions.offload_overlap` false: `estimate.stage_time`).

Public functions:
    apply_offload(blocks, num_layers) -> number of blocks wrapped
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def apply_offload(blocks: list[tuple[str, nn.Module]], num_layers: int) -> int:
    """Wrap the forward of the first ``num_layers`` blocks so their saved activations wait in
    host memory; returns how many were wrapped (fewer on a chunk of fewer blocks). Raises
    ValueError for a negative count."""
    if num_layers < 0:
        raise ValueError(f"offload_layers must be >= 0, got {num_layers}")
    chosen = blocks[:num_layers]
    for _, block in chosen:
        block.forward = _offloaded(block.forward)  # instance attribute: nn.Module calls it
    return len(chosen)


def _offloaded(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # pinned host memory needs a GPU; on CPU ranks the copy is host to host
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return forward(*args, **kwargs)

    run.offloads_activations = True  # type: ignore[attr-defined]  # what tests read back
    return run
