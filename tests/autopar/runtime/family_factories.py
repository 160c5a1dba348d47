"""Thirteen more model families a user builds with their own factories (issue 47), beside
`model_factories`' ten, and three found computing another model or holding other bytes than
planned under tensor parallelism when 26 more families were tried (OPT, ModernBERT, MPT): tiny
configs of the same sizes, no dropout, fp32, each seeded.

Decoders take token ids and the next-token loss; the encoder has its own data hook and loss.
"""

from __future__ import annotations

import torch
from model_factories import HEADS, HIDDEN, LAYERS, VOCAB, _hf
from torch import nn
from torch.nn import functional as F

_HEAD = HIDDEN // HEADS
_DECODER = dict(
    num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
    num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def olmo2() -> nn.Module:
    return _hf("Olmo2Config", "Olmo2ForCausalLM", **_DECODER, num_key_value_heads=HEADS)


def gemma3() -> nn.Module:
    """Sliding and full attention layers alternating, a window shorter than the sequence."""
    return _hf("Gemma3TextConfig", "Gemma3ForCausalLM", **_DECODER, num_key_value_heads=2,
               head_dim=_HEAD, query_pre_attn_scalar=_HEAD, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))  # fmt: skip


def falcon() -> nn.Module:
    """Falcon-7B's layout: one key/value head (multi-query) in a fused query_key_value, and
    attention and MLP in parallel."""
    return _hf("FalconConfig", "FalconForCausalLM", num_hidden_layers=LAYERS,
               hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
               hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
               eos_token_id=0)  # fmt: skip


def stablelm() -> nn.Module:
    return _hf("StableLmConfig", "StableLmForCausalLM", **_DECODER, num_key_value_heads=HEADS)


def granite() -> nn.Module:
    return _hf("GraniteConfig", "GraniteForCausalLM", **_DECODER, num_key_value_heads=2)


def granite_moe() -> nn.Module:
    return _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", **_DECODER, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2)  # fmt: skip


def olmoe() -> nn.Module:
    return _hf("OlmoeConfig", "OlmoeForCausalLM", **_DECODER, num_key_value_heads=HEADS,
               num_experts=4, num_experts_per_tok=2)  # fmt: skip


def qwen3_tied() -> nn.Module:
    return _hf("Qwen3Config", "Qwen3ForCausalLM", **_DECODER, num_key_value_heads=2,
               head_dim=_HEAD, tie_word_embeddings=True)  # fmt: skip


def llama4() -> nn.Module:
    """Llama 4's text model: MoE with a shared expert every other layer, chunked attention
    on three of four layers, no rope on the fourth."""
    return _hf("Llama4TextConfig", "Llama4ForCausalLM", **_DECODER, num_key_value_heads=2,
               head_dim=_HEAD, intermediate_size_mlp=2 * HIDDEN, num_local_experts=4,
               num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
               layer_types=["chunked_attention"] * 3 + ["full_attention"],
               no_rope_layers=[1, 1, 1, 0])  # fmt: skip


def cohere() -> nn.Module:
    """Cohere with `use_qk_norm`: a layer norm over [heads, head_dim]."""
    return _hf("CohereConfig", "CohereForCausalLM", **_DECODER, num_key_value_heads=HEADS,
               use_qk_norm=True)  # fmt: skip


def mamba2() -> nn.Module:
    return _hf("Mamba2Config", "Mamba2ForCausalLM", num_hidden_layers=LAYERS,
               hidden_size=HIDDEN, vocab_size=VOCAB, state_size=8, expand=2, n_groups=1,
               head_dim=_HEAD, num_heads=2 * HIDDEN // _HEAD, chunk_size=8, bos_token_id=0,
               eos_token_id=0, pad_token_id=0)  # fmt: skip


def smollm3() -> nn.Module:
    return _hf("SmolLM3Config", "SmolLM3ForCausalLM", **_DECODER, num_key_value_heads=2)


def opt() -> nn.Module:
    """OPT views q, k and v by ``view(bsz, -1, heads, head_dim)``: on a tp rank's half of the
    features it runs, folding half of them into the sequence axis."""
    return _hf("OPTConfig", "OPTForCausalLM", num_hidden_layers=LAYERS, hidden_size=HIDDEN,
               ffn_dim=2 * HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
               max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0,
               attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0)  # fmt: skip


def modernbert() -> nn.Module:
    """ModernBERT's fused Wqkv is viewed as (3, heads, head_dim) and unbound; its MLP's Wi is
    chunked in two. Local and global attention layers, bidirectional."""
    return _hf("ModernBertConfig", "ModernBertForMaskedLM", **_DECODER,
               global_attn_every_n_layers=2, local_attention=8, embedding_dropout=0.0,
               mlp_dropout=0.0, attention_dropout=0.0, cls_token_id=0,
               sep_token_id=0)  # fmt: skip


def mpt() -> nn.Module:
    """MPT's MLP splits by its names (up_proj, down_proj), its fused Wqkv by no rule: its code
    views heads by the config's count."""
    return _hf("MptConfig", "MptForCausalLM", d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS,
               max_seq_len=64, vocab_size=VOCAB, expansion_ratio=2, resid_pdrop=0.0,
               emb_pdrop=0.0, attn_config={"attn_pdrop": 0})  # fmt: skip


class Encoder(nn.Module):
    """A sequence classifier on nn.TransformerEncoderLayer, pre-norm, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def encoder() -> nn.Module:
    torch.manual_seed(0)
    return Encoder()


def encoder_batch(step: int, start: int, stop: int):
    """Token sequences labelled by their most frequent token's residue mod 10."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (8, 16), generator=gen)
    labels = torch.mode(ids % 10, dim=1).values
    return (ids[start:stop],), labels[start:stop]


def encoder_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)
