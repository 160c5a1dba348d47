"""The shape of a published GPT-style run, and the FLOP counts its sources and we use.

`ModelDims`: a decoder's dimensions in the zoo GPT's terms (`autopar/models/gpt.py`).
FLOP formulas, one function each with its source: `megatron_2021_eq3_flops` (Narayanan et al.
2021), `megatron_core_2024_flops` (Megatron-LM's count of Jul 2024), and our own `model_flops`
(the MFU numerator of every measured MFU the benchmarks print). `SOURCE_FLOP_FORMULA` maps a
source key to the formula its published TFLOP/s figures used
(`published_runs_mapping`, which reads the runs).

Notation: B global batch (sequences), s sequence length, l layers, h hidden, f FFN width,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """A GPT-style decoder's shape, in the zoo GPT's terms (`autopar/models/gpt.py`)."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    seq_len: int
    bias: bool = True
    tie_embeddings: bool = True
    # Megatron before FlashAttention (2020-2022) ran attention step by step and kept the s x s
    # probabilities; Megatron-Core 2024 (Transformer Engine) and MPT use fused attention.
    attention: str = "flash"
    dropout: float = 0.0

    def gpt_overrides(self) -> dict[str, object]:
        """Keyword overrides for `zoo.build("gpt-tiny", ...)`; ValueError where GPT cannot."""
        if self.ffn_hidden % self.hidden:
            raise ValueError(f"ffn_hidden={self.ffn_hidden} is not a multiple of {self.hidden}")
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"the zoo GPT is MHA; kv_heads={self.num_kv_heads} given")
        return {
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "num_heads": self.num_heads,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "mlp_ratio": self.ffn_hidden // self.hidden,
            "bias": self.bias,
            "tie_embeddings": self.tie_embeddings,
            "dropout": self.dropout,
            "attention": self.attention,
        }

    def num_params(self) -> int:
        """Parameters of the zoo GPT of this shape (embeddings, positions, blocks, final norm)."""
        h, f = self.hidden, self.ffn_hidden
        per_layer = 4 * h * h + 2 * h * f + 2 * h  # qkv, proj, fc, proj; two LayerNorm weights
        final = h
        if self.bias:
            per_layer += 3 * h + h + f + h + 2 * h  # linear biases and LayerNorm biases
            final += h
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + final + embeddings + self.seq_len * h

    def as_text(self) -> str:
        return (
            f"l={self.num_layers} h={self.hidden} f={self.ffn_hidden} a={self.num_heads} "
            f"V={self.vocab_size} s={self.seq_len}"
            + ("" if self.bias else " nobias")
            + ("" if self.tie_embeddings else " untied")
        )


def megatron_2021_eq3_flops(dims: ModelDims, batch_seqs: int) -> float:
    """FLOPs per step as Narayanan et al. 2021 (arXiv 2104.04473) eq. 3 counts them.

    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): forward, backward and the full-recompute
    forward of every transformer layer (4 x 24 B s l h^2) plus 3 x the logit GEMM. Their
    TFLOP/s and '% of peak' (an HFU) are F / time; Table 1, Table 2 and the Jan 2021 README.
    """
    b, s, n, h, v = batch_seqs, dims.seq_len, dims.num_layers, dims.hidden, dims.vocab_size
    return 96.0 * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n * h))


def megatron_core_2024_flops(dims: ModelDims, batch_seqs: int) -> float:
    """FLOPs per step as Megatron-LM's `num_floating_point_operations` counted them in Jul 2024.

    megatron/training/training.py, `num_floating_point_operations(args, batch_size)` as of
    Megatron-Core r0.8.0 (the release of the README's 2024 table):
        12 B s l h^2 ( (1 + g/a + s/h) * q/h  +  (f/h) * k * glu  +  V / (2 l h) )
    with g query groups, a heads, q = kv_channels * a (= h here), k experts routed to (1), glu
    3/2 for SwiGLU (1 here). No recompute term: their TFLOP/s / 990 is their MFU. For a GPT
    with MHA and f = 4h this is 72 B s l h^2 (1 + s/(6h) + V/(12 l h)), equal to `model_flops`.
    (Later versions halve the s/h term for the causal mask; the 2024 table predates that.)
    """
    b, s, n, h, v = batch_seqs, dims.seq_len, dims.num_layers, dims.hidden, dims.vocab_size
    g_over_a = dims.num_kv_heads / dims.num_heads
    attention = 1.0 + g_over_a + s / h
    mlp = dims.ffn_hidden / h
    logit = v / (2.0 * n * h)
    return 12.0 * b * s * n * h * h * (attention + mlp + logit)


def model_flops(dims: ModelDims, batch_seqs: int) -> float:
    """Our own model FLOPs per step (MFU numerator; no recompute), used for every measured MFU.

    Per token: 6 x (the matmul parameters of the blocks + the logit GEMM) + 12 l s h for the
    attention scores and values (forward 2 x 2 s h per layer, backward twice that), counted over
    the full s x s matrix as Korthikanti et al. 2022 (arXiv 2205.05198) sec 6 and PaLM App. B
    do. For MHA, f = 4h: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    """
    b, s, n, h = batch_seqs, dims.seq_len, dims.num_layers, dims.hidden
    kv = h * dims.num_kv_heads // dims.num_heads
    block_matmul = h * (h + 2 * kv) + h * h + 2 * h * dims.ffn_hidden
    per_token = 6 * (n * block_matmul + h * dims.vocab_size) + 12 * n * s * h
    return float(b * s * per_token)


SOURCE_FLOP_FORMULA = {
    "meg21": megatron_2021_eq3_flops,
    "mcore24": megatron_core_2024_flops,
}
