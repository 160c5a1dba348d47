"""Mixture-of-experts decoder: Llama layers whose MLP is a top-k routed set of SwiGLU experts.

In: `MoEConfig` (frozen) -> `MoE` module. `MoE(ids_BS) -> logits_BSV`.
Layer `i` (0-based) has an `MoEBlock` as its `mlp` when `(i + 1) % every_n == 0`, a dense
`SwiGLU` otherwise: `every_n=1` (Mixtral) makes every layer MoE, `every_n=2` every second one
(GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Routing, as Mixtral (Jiang et al. 2024): `p = softmax(router(x))` over E experts, keep the top k,
renormalise them to sum to 1; the token's output is `sum_e w_e * expert_e(x)`.

Dense dispatch, and what it means for FLOP counts. An export-friendly MoE cannot gather each
expert's tokens: the per-expert token count is data-dependent, so the shapes would be too.
`MoEBlock` therefore runs EVERY expert on EVERY token and combines the outputs with a dense
`[T, E]` weight matrix that is zero outside each token's top k. The numbers equal routed
dispatch, but the graph holds E/k times the routed expert FLOPs:

    dense expert FLOPs  = E * 6 * T * H * F     (per expert: gate, up, down matmuls, 2*T*H*F each)
    routed expert FLOPs = k * 6 * T * H * F     = dense * top_k / num_experts

A tracer or planner must count routed FLOPs (and per-token activation memory) for the experts
of a module with `dense_dispatch = True`: scale the FLOPs under `experts` by
`MoEBlock.routed_flop_fraction` (= top_k / num_experts). The router and the combine are small
and counted as they are. `num_experts` and `top_k` are plain attributes of `MoEBlock`.

Shape legend: B batch, S sequence, T tokens (B*S), H hidden, E experts, K top k, F expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.layers import SwiGLU
from autopar.models.llama import DecoderLM, LlamaConfig


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A `LlamaConfig` plus the experts. Defaults are the tiny test model.

    `ffn_hidden` is the width of the dense MLPs of non-MoE layers; `expert_ffn_hidden` that of
    each expert.
    """

    num_experts: int = 4
    top_k: int = 2
    expert_ffn_hidden: int = 128
    every_n: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} must be in 1..num_experts={self.num_experts}"
            )
        if self.every_n < 1:
            raise ValueError(f"MoEConfig: every_n={self.every_n} must be >= 1")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` (0-based) has an MoE MLP: every `every_n`-th layer."""
        return (layer_idx + 1) % self.every_n == 0


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts with dense dispatch (see the module docstring).

    Attributes read by the tracer: `num_experts`, `top_k`, `dense_dispatch` (True: the graph
    computes all experts on all tokens) and `routed_flop_fraction` (top_k / num_experts).
    """

    dense_dispatch = True

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, ffn_hidden) for _ in range(num_experts))
        # None: dense dispatch here (export-friendly). Expert parallelism
        # (autopar.runtime.expert_parallel) sets an all-to-all dispatcher,
        # `dispatch(x_TH, w_TE, experts) -> out_TH`, and keeps only this rank's experts.
        self.dispatch = None

    @property
    def routed_flop_fraction(self) -> float:
        """Routed expert FLOPs / the dense graph's expert FLOPs."""
        return self.top_k / self.num_experts

    def routing_weights(self, x_TH: torch.Tensor) -> torch.Tensor:
        """`[T, E]` combine weights in fp32: the renormalised top-k probabilities, 0 elsewhere."""
        probs_TE = F.softmax(self.router(x_TH).float(), dim=-1)
        top_TK, idx_TK = probs_TE.topk(self.top_k, dim=-1)
        top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs_TE).scatter(-1, idx_TK, top_TK)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, h = x_BSH.shape
        x_TH = x_BSH.reshape(b * s, h)
        w_TE = self.routing_weights(x_TH).to(x_BSH.dtype)
        combine = self.dispatch if self.dispatch is not None else self.dense_combine
        return combine(x_TH, w_TE, self.experts).view(b, s, h)

    @staticmethod
    def dense_combine(x_TH: torch.Tensor, w_TE: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """sum_e w[:, e] * expert_e(x) over every expert of ``experts`` (all of them, in order),
        on every token: the dense dispatch."""
        out_TH = torch.zeros_like(x_TH)
        for e, expert in enumerate(experts):
            out_TH = out_TH + w_TE[:, e : e + 1] * expert(x_TH)
        return out_TH


class MoE(DecoderLM):
    """Mixture-of-experts language model: token ids `[B, S]` -> logits `[B, S, V]`."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, lambda i: _make_mlp(config, i))


def _make_mlp(config: MoEConfig, layer_idx: int) -> nn.Module:
    if config.is_moe_layer(layer_idx):
        return MoEBlock(config.hidden, config.expert_ffn_hidden, config.num_experts, config.top_k)
    return SwiGLU(config.hidden, config.ffn_hidden)
