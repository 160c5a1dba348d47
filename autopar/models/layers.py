"""Building blocks shared by the zoo's decoders: RMSNorm, RoPE, grouped-query attention, SwiGLU.

In: activations `x_BSH` (float, any device including meta). Out: activations of the same shape.
Invariant: every forward is export-friendly -- shapes come from `x.shape` only, there is no
data-dependent Python control flow and no `.item()`, so `torch.export.export(strict=False)`
captures one straight-line aten graph on meta or fake tensors.

Names follow Hugging Face's Llama (`q_proj`, `gate_proj`, ...), so a tensor-parallel plan written
for the zoo reads the same as one for a Hugging Face model.

Shape legend: B batch, S sequence, H hidden, N query heads, K key/value heads, D head dim,
F feed-forward hidden.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 as Llama does.

    Written out as pow/mean/rsqrt rather than `F.rms_norm` so the traced graph holds plain
    elementwise and reduction ops that every FLOP counter and sharding rule knows.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables `cos_SD`, `sin_SD` (Su et al. 2021), built in-graph from `arange`.

    The half-split ("rotate_half") layout of Hugging Face's Llama: frequency i sits at dims i and
    i + D/2.
    """
    inv_freq_D2 = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    pos_S = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs_SD2 = pos_S[:, None] * inv_freq_D2[None, :]  # a mul, not aten.outer: every rule knows it
    emb_SD = torch.cat((freqs_SD2, freqs_SD2), dim=-1)
    return emb_SD.cos(), emb_SD.sin()


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate `x_BNSD` by the position tables (broadcast over batch and heads)."""
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat((-x_BNSD[..., half:], x_BNSD[..., :half]), dim=-1)
    cos, sin = cos_SD.to(x_BNSD.dtype), sin_SD.to(x_BNSD.dtype)
    return x_BNSD * cos + rotated * sin


class SwiGLU(nn.Module):
    """Gated MLP `down(silu(gate(x)) * up(x))` (Shazeer 2020), no biases, as in Llama."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Causal self-attention with grouped-query heads (Ainslie et al. 2023) and RoPE.

    `num_kv_heads` divides `num_heads`; each key/value head serves `num_heads // num_kv_heads`
    query heads. The `attention_fn` hook takes the key/value heads unrepeated, with SDPA's
    signature and `enable_gqa=True`; the default (`repeated_kv_attention`) repeats them with
    expand+reshape (as Hugging Face's `repeat_kv`) rather than SDPA's `enable_gqa`, so the
    attention op sees equal head counts, which FLOP counters and DTensor's attention rules
    expect, while context parallelism's hook moves the K heads, not their N-head repeat.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)
        # called with SDPA's signature; context parallelism (autopar.runtime.context_parallel)
        # swaps in its own for the sequence shards
        self.attention_fn = repeated_kv_attention

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        d = self.head_dim
        q_BNSD = self.q_proj(x_BSH).view(b, s, -1, d).transpose(1, 2)
        k_BKSD = self.k_proj(x_BSH).view(b, s, -1, d).transpose(1, 2)
        v_BKSD = self.v_proj(x_BSH).view(b, s, -1, d).transpose(1, 2)
        q_BNSD = apply_rope(q_BNSD, cos_SD, sin_SD)
        k_BKSD = apply_rope(k_BKSD, cos_SD, sin_SD)
        dropout_p = self.dropout if self.training else 0.0
        y_BNSD = self.attention_fn(
            q_BNSD, k_BKSD, v_BKSD, is_causal=True, dropout_p=dropout_p, enable_gqa=True
        )
        return self.o_proj(y_BNSD.transpose(1, 2).reshape(b, s, -1))


def repeated_kv_attention(
    q_BNSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA over the key/value heads repeated to the query heads (`repeat_kv`): the zoo's
    `GQAttention.attention_fn` by default (its docstring says why not `enable_gqa`)."""
    n = kv_repeats(q_BNSD, k_BKSD, enable_gqa)
    return F.scaled_dot_product_attention(
        q_BNSD, repeat_kv(k_BKSD, n), repeat_kv(v_BKSD, n), is_causal=is_causal,
        dropout_p=dropout_p,
    )  # fmt: skip


def kv_repeats(q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, enable_gqa: bool) -> int:
    """How many query heads each key/value head serves; as SDPA, unequal head counts only with
    ``enable_gqa`` (a ValueError naming both counts otherwise)."""
    if k_BKSD.shape[1] != q_BNSD.shape[1] and not enable_gqa:
        raise ValueError(f"{q_BNSD.shape[1]} query heads but {k_BKSD.shape[1]} key heads")
    return q_BNSD.shape[1] // k_BKSD.shape[1]


def repeat_kv(x_BKSD: torch.Tensor, num_repeats: int) -> torch.Tensor:
    """`[B, K, S, D] -> [B, K * num_repeats, S, D]`, each kv head repeated in place."""
    if num_repeats == 1:  # a config constant, not data: export sees one branch
        return x_BKSD
    b, k, s, d = x_BKSD.shape
    expanded = x_BKSD[:, :, None, :, :].expand(b, k, num_repeats, s, d)
    return expanded.reshape(b, k * num_repeats, s, d)


def dropout(p: float) -> nn.Module:
    """`nn.Dropout(p)`, or `nn.Identity()` when p == 0 so the traced graph holds no no-op nodes."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def init_weights(model: nn.Module, std: float, residual_std: float, residual_names: set[str]):
    """GPT-2 initialisation: N(0, std) for Linear and Embedding weights, zero biases.

    Linear layers whose attribute name is in `residual_names` (the projections that write into
    the residual stream) get `residual_std`, std / sqrt(2 * num_layers) in GPT-2 (Radford et al.
    2019, section 2.3) so the residual stream's variance does not grow with depth.
    Norm weights keep their ones.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            nn.init.normal_(module.weight, 0.0, residual_std if leaf in residual_names else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)


def residual_init_std(std: float, num_layers: int) -> float:
    """`std / sqrt(2 * num_layers)`: two residual writes (attention, MLP) per layer."""
    return std / math.sqrt(2 * num_layers)
