"""Models a user builds with their own factories (not autopar's builders), for the tests
that run any traced model under any plan: tiny configs, no dropout, fp32.

Each factory returns a fresh, seeded model. Non-language models come with their data hook
(`fn(step, start, stop) -> (inputs, targets)`) and loss (`loss(outputs, targets)`), named as
a plan records them ("model_factories:vit_batch").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 4


class TinyTransformer(nn.Module):
    """A from-scratch language model on nn.TransformerEncoderLayer (nn.MultiheadAttention)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": VOCAB})()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def tiny_transformer() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return BertForMaskedLM(config)


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's token (no shift: an encoder predicts in place)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _hf(config_cls: str, model_cls: str, **fields) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**fields)
    return getattr(transformers, model_cls)(config)


_DECODER = dict(
    num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
    num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=64,
)  # fmt: skip


def gpt_neox() -> nn.Module:
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DECODER, hidden_dropout=0.0,
               attention_dropout=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip


def gemma2() -> nn.Module:
    return _hf("Gemma2Config", "Gemma2ForCausalLM", **_DECODER, num_key_value_heads=2,
               head_dim=HIDDEN // HEADS, pad_token_id=0, bos_token_id=0,
               eos_token_id=0)  # fmt: skip


def phi3(kv_heads: int = HEADS) -> nn.Module:
    """Phi-3-mini's layout (as many key/value heads as query heads) by default; Phi-3-medium
    has fewer (40 and 10), which its fused qkv_proj cuts into pieces of unequal widths."""
    return _hf("Phi3Config", "Phi3ForCausalLM", **_DECODER, num_key_value_heads=kv_heads,
               pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip


def qwen2() -> nn.Module:
    return _hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER, num_key_value_heads=2)


class Seq2Seq(nn.Module):
    """T5 called with (encoder ids, decoder ids) by position, as a data hook gives them (T5's
    own second positional argument is the attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.t5 = _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB,
                      d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=2,
                      num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0)  # fmt: skip
        self.config = self.t5.config

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits


def t5() -> nn.Module:
    return Seq2Seq()


def t5_batch(step: int, start: int, stop: int):
    """(encoder ids, decoder ids) -> decoder targets: copy the input, shifted right."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (8, 16), generator=gen)[start:stop]
    decoder_in = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
    return (ids, decoder_in), ids


def vit() -> nn.Module:
    return _hf("ViTConfig", "ViTForImageClassification", hidden_size=HIDDEN,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
               image_size=16, patch_size=4, num_labels=10, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)  # fmt: skip


def vit_batch(step: int, start: int, stop: int):
    """Images of 3 x 16 x 16 whose label is the brightest channel's quadrant (learnable)."""
    gen = torch.Generator().manual_seed(step)
    images = torch.randn(8, 3, 16, 16, generator=gen)
    labels = torch.randint(0, 10, (8,), generator=gen)
    return (images[start:stop],), labels[start:stop]


def classify_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


class Classifier(nn.Module):
    """An MLP classifier: no sequence, no list of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(x))


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()


def classifier_batch(step: int, start: int, stop: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=gen)
    return (x[start:stop],), x[start:stop, :10].argmax(dim=1)
