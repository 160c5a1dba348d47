"""GPT-2 style decoder (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP.

In: `GPTConfig` (frozen) -> `GPT` module. `GPT(ids_BS) -> logits_BSV` (float32 by default).
Invariant: `ids_BS.shape[1] <= config.seq_len` (the learned position table's size); the forward
is export-friendly (no data-dependent control flow), so `torch.export.export(strict=False)` on
the meta device captures it whole.

Layout: `tok_emb`, `pos_emb`, `blocks` (an `nn.ModuleList` of `GPTBlock`), `ln_f`, `lm_head`
(tied to `tok_emb` by default, as GPT-2). With `bias=True` and vocab 50257, hidden 768, 12 layers,
12 heads, seq 1024 the parameter count equals Hugging Face's GPT-2 (124,439,808).

The fused `qkv` projection stores its output features head-major, `[N, 3, D]` (Megatron-LM's
layout, Shoeybi et al. 2019), not `[3, N, D]` as GPT-2's checkpoints do: sharding `qkv`'s
output features over tensor-parallel ranks then splits whole heads, each with its q, k and v.

Shape legend: B batch, S sequence, H hidden, N heads, D head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.causal_softmax import causal_softmax
from autopar.models.layers import dropout, init_weights, residual_init_std

ATTENTIONS = ("flash", "math", "megatron")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a GPT. Defaults are the tiny test model."""

    vocab_size: int = 128
    seq_len: int = 32
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    # "flash": F.scaled_dot_product_attention (fused, no s x s tensors kept); "math": scores,
    # scale, mask, softmax, dropout and the value product as separate ops (eager PyTorch, as
    # Hugging Face's GPT-2 ran them), keeping the s x s probabilities; "megatron": the same
    # maths as pre-FlashAttention Megatron-LM (2020-2022) ran it, the scale in the score GEMM
    # and the mask and softmax one kernel (`autopar.models.causal_softmax`).
    attention: str = "flash"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"GPTConfig: attention must be one of {', '.join(ATTENTIONS)}, "
                f"got {self.attention!r}"
            )
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not divisible by num_heads={self.num_heads}"
            )


class GPTAttention(nn.Module):
    """Causal multi-head attention, fused (`scaled_dot_product_attention`) or step by step."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.math = config.attention != "flash"
        self.megatron = config.attention == "megatron"
        self.num_heads = config.num_heads
        self.head_dim = config.hidden // config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.resid_dropout = dropout(config.dropout)
        # the fused attention, called with SDPA's signature; context parallelism
        # (autopar.runtime.context_parallel) swaps in its own for the sequence shards
        self.attention_fn = F.scaled_dot_product_attention

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        d = self.head_dim
        qkv_BSN3D = self.qkv(x_BSH).view(b, s, -1, 3 * d)  # -1: local heads under TP
        q_BSND, k_BSND, v_BSND = qkv_BSN3D.split(d, dim=-1)
        dropout_p = self.dropout if self.training else 0.0
        q_BNSD, k_BNSD, v_BNSD = (t.transpose(1, 2) for t in (q_BSND, k_BSND, v_BSND))
        if self.math:
            step_by_step = _megatron_attention if self.megatron else _math_attention
            y_BNSD = step_by_step(q_BNSD, k_BNSD, v_BNSD, dropout_p, self.training)
        else:
            y_BNSD = self.attention_fn(q_BNSD, k_BNSD, v_BNSD, is_causal=True, dropout_p=dropout_p)
        return self.resid_dropout(self.proj(y_BNSD.transpose(1, 2).reshape(b, s, -1)))


def _math_attention(
    q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v with dropout on the probabilities."""
    s, d = q_BNSD.shape[-2], q_BNSD.shape[-1]
    scores_BNSS = torch.matmul(q_BNSD, k_BNSD.transpose(-2, -1)) * (d**-0.5)
    pos_S = torch.arange(s, device=q_BNSD.device)
    future_SS = pos_S[None, :] > pos_S[:, None]
    probs_BNSS = torch.softmax(scores_BNSS.masked_fill(future_SS, float("-inf")), dim=-1)
    probs_BNSS = F.dropout(probs_BNSS, p=p, training=training)
    return torch.matmul(probs_BNSS, v_BNSD)


def _megatron_attention(
    q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """`_math_attention`'s maths as Megatron-LM ran it: the scale on the query (Megatron puts
    it in the score GEMM's alpha; here an op of s x d per head, not s x s), then the masked
    softmax as one op."""
    scores_BNSS = torch.matmul(q_BNSD * q_BNSD.shape[-1] ** -0.5, k_BNSD.transpose(-2, -1))
    probs_BNSS = F.dropout(causal_softmax(scores_BNSS), p=p, training=training)
    return torch.matmul(probs_BNSS, v_BNSD)


class GPTMLP(nn.Module):
    """`proj(gelu_tanh(fc(x)))` with a `mlp_ratio * hidden` inner width (GPT-2's "gelu_new")."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        inner = config.mlp_ratio * config.hidden
        self.fc = nn.Linear(config.hidden, inner, bias=config.bias)
        self.proj = nn.Linear(inner, config.hidden, bias=config.bias)
        self.dropout = dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class GPTBlock(nn.Module):
    """Pre-norm residual block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.ln_1 = nn.LayerNorm(config.hidden, eps=eps, bias=config.bias)
        self.attn = GPTAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=eps, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln_1(x_BSH))
        return x_BSH + self.mlp(self.ln_2(x_BSH))


class GPT(nn.Module):
    """GPT-2 style language model: token ids `[B, S]` -> logits `[B, S, V]`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.emb_dropout = dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        init_weights(
            self,
            std=config.init_std,
            residual_std=residual_init_std(config.init_std, config.num_layers),
            residual_names={"proj"},
        )

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        pos_S = torch.arange(ids_BS.shape[1], device=ids_BS.device)
        x_BSH = self.emb_dropout(self.tok_emb(ids_BS) + self.pos_emb(pos_S))
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.lm_head(self.ln_f(x_BSH))
