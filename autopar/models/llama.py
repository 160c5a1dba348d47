"""Llama style decoder (Touvron et al. 2023): RMSNorm, RoPE, grouped-query attention, SwiGLU.

In: `LlamaConfig` (frozen) -> `Llama` module. `Llama(ids_BS) -> logits_BSV`.
Invariant: the rotary tables are computed in the graph from `arange` (no buffers, nothing
data-dependent), so `torch.export.export(strict=False)` captures the model on the meta device
for any sequence length. The head is untied from the embedding.

Layout, named as Hugging Face's `LlamaForCausalLM` so plans read alike: `embed_tokens`,
`layers` (an `nn.ModuleList` of `LlamaLayer`: `input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`), `norm`, `lm_head`. With Llama 3 8B's shape the parameter
count equals Hugging Face's (8,030,261,248).

The MoE model (`autopar.models.moe`) reuses `LlamaLayer` with a different `mlp`.

Shape legend: B batch, S sequence, H hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autopar.models.layers import (
    GQAttention,
    RMSNorm,
    SwiGLU,
    init_weights,
    residual_init_std,
    rope_cos_sin,
)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and options of a Llama. Defaults are the tiny test model."""

    vocab_size: int = 128
    seq_len: int = 32
    num_layers: int = 2
    hidden: int = 64
    ffn_hidden: int = 176
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        check_attention_shape(self.hidden, self.num_heads, self.num_kv_heads, type(self).__name__)


def check_attention_shape(hidden: int, num_heads: int, num_kv_heads: int, where: str) -> None:
    """Raise ValueError unless heads divide `hidden` and kv heads divide heads."""
    if hidden % num_heads:
        raise ValueError(f"{where}: hidden={hidden} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{where}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
        )
    if (hidden // num_heads) % 2:
        raise ValueError(f"{where}: head dim {hidden // num_heads} must be even for RoPE")


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    `mlp` is any module mapping `[B, S, H] -> [B, S, H]`: a `SwiGLU` here, an `MoEBlock` in the
    MoE model.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        mlp: nn.Module,
        norm_eps: float,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, norm_eps)
        self.self_attn = GQAttention(hidden, num_heads, num_kv_heads, dropout)
        self.post_attention_layernorm = RMSNorm(hidden, norm_eps)
        self.mlp = mlp

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> torch.Tensor:
        x_BSH = x_BSH + self.self_attn(self.input_layernorm(x_BSH), cos_SD, sin_SD)
        return x_BSH + self.mlp(self.post_attention_layernorm(x_BSH))


class DecoderLM(nn.Module):
    """Embedding, a stack of `LlamaLayer`s, final RMSNorm, untied head.

    Args:
        config: a config with the `LlamaConfig` fields (the MoE config adds its own).
        make_mlp: called with the layer index, returns that layer's MLP module.
    """

    def __init__(self, config: LlamaConfig, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden // config.num_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(
            LlamaLayer(
                config.hidden,
                config.num_heads,
                config.num_kv_heads,
                make_mlp(i),
                config.norm_eps,
                config.dropout,
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        init_weights(
            self,
            std=config.init_std,
            residual_std=residual_init_std(config.init_std, config.num_layers),
            residual_names={"o_proj", "down_proj"},
        )

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        cos_SD, sin_SD = rope_cos_sin(
            ids_BS.shape[1], self.head_dim, self.config.rope_theta, ids_BS.device
        )
        x_BSH = self.embed_tokens(ids_BS)
        for layer in self.layers:
            x_BSH = layer(x_BSH, cos_SD, sin_SD)
        return self.lm_head(self.norm(x_BSH))


class Llama(DecoderLM):
    """Llama style language model: token ids `[B, S]` -> logits `[B, S, V]`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, lambda _: SwiGLU(config.hidden, config.ffn_hidden))
