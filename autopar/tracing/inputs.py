"""One sample's inputs when the user gives none.

In: a model whose config names its context length (Hugging Face causal LMs:
`max_position_embeddings`; the zoo's language models: `seq_len`). Out: token ids of that length,
batch 1, on the model's device (meta for a model on meta). Anything else needs the user's
inputs, and the error says so.
"""

from __future__ import annotations

import torch
from torch import nn


def infer_example_inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """Token ids of the model's context length for HF causal LMs and the zoo's LMs.

    Raises:
        ValueError: the model's config names no context length.
    """
    config = getattr(model, "config", None)
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_len", None)
    if seq is None:
        raise ValueError(
            f"cannot infer example inputs for {type(model).__name__}: pass example_inputs "
            "(one sample, batch dimension 1)"
        )
    device = next(model.parameters()).device
    return (torch.zeros(1, int(seq), dtype=torch.long, device=device),)
