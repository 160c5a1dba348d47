"""Memory per device of one training plan, in bytes.

In: counts and shapes (parameters, sequence, batch, hidden sizes), parallel degrees and
policies. Out: bytes per device as frozen dataclasses that print themselves. Pure functions,
no torch; every result is a float because the share of a sharded tensor need not be whole.

The peak on one device (``PeakMemory.total_bytes``) is

    M = P + G + O + A + C + R

Model state (``model_state_bytes``), Psi parameters, ZeRO shard degree N (Rajbhandari et al.
2020, "ZeRO", sec 3.1 and 5):

    P = w Psi / N3,   G = w Psi / N2,   O = K Psi / N1,    Nk = N if zero_stage >= k else 1

with w = 2 bytes for bf16/fp16 and 4 for fp32. Mixed precision keeps an fp32 master copy of the
weights, so K = 4 + (fp32 optimizer state): Adam K = 4 + 4 + 4 = 12 (ZeRO's K), SGD with
momentum K = 8, plain SGD K = 4; fp32 training has no master copy (Adam 4 + 4 + 8 = 16 bytes).
FSDP2 with a bf16 param_dtype keeps fp32 sharded parameters and gradients instead: the same
16 / N bytes for Adam, split differently. Its unsharded, all-gathered layers are transient and
belong in C. Gradients accumulated in fp32 (Megatron's main_grad) add 2 Psi / N2: not modelled.

Activations of one transformer layer (``transformer_layer_activation_bytes``), Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec 4. Symbols: s
sequence, b micro-batch, h hidden, a heads, k kv heads, f ffn hidden, e bytes per element, m = 1
byte per dropout-mask element (0 without dropout), t tensor-parallel degree, c context-parallel
degree. The paper's derivation (e = 2, m = 1, k = a, f = 4h) tensor by tensor:

    attention (``ActivationBytes.attention_bytes``)        QKV input 2sbh, Q 2sbh, K 2sbh,
                                                           V 2sbh, output-projection input 2sbh
    attention scores (``.attention_scores_bytes``)         softmax output 2as^2b, its dropout
                                                           mask as^2b, dropout output 2as^2b
    MLP (``.mlp_bytes``)                                   input 2sbh, activation input 8sbh,
                                                           activation output 8sbh
    layer norms (``.layer_norm_bytes``)                    two inputs, 4sbh
    dropout masks (``.dropout_mask_bytes``)                after attention and after MLP, 2sbh

    total = 34sbh + 5as^2b = sbh (34 + 5as/h)

Generalised: K and V are e sb (h/a) ceil(k/t) per rank (GQA; fewer kv heads than t are
replicated, one per rank); the MLP keeps e sbf twice, or three times when gated (SwiGLU: gate
and up outputs, and their product that feeds the down projection; a fused SwiGLU, as in
Megatron-Core, recomputes silu(gate) in backward; an unfused eager one also keeps it, 4 e sbf);
with dropout=False the masks and the dropout output go, leaving e as^2b for the scores; with
flash attention the s^2 terms are replaced by one fp32 log-sum-exp per query row and head,
4 asb (Dao 2023, FlashAttention-2, Alg. 1 saves L; its dropout mask is regenerated from the RNG
state, not stored).

Tensor parallelism splits heads and f, so Q, K, V, the output-projection input, the MLP
activation tensors and the scores divide by t; the layer-norm inputs, the QKV and MLP inputs and
the two masks lie outside the TP region and stay whole unless sequence parallelism splits them
along s: sbh (10 + 24/t + 5as/(ht)) with TP only, sbh/t (34 + 5as/h) with TP + SP.

Context parallelism gives each rank s/c of the queries and of the keys and values it keeps, so
every sbh term uses s/c. Assumption for eager attention: a rank keeps the probabilities of its
s/c queries against all s keys (the blocks of every ring step kept for backward), so the s^2
terms become s^2/c. In practice CP runs with flash attention, whose statistics are O(s/c).

Recomputation (``recompute``): "selective" recomputes the core attention, dropping the scores
(34sbh/t with TP + SP); "full" keeps only the layer input, ``saved_input_bytes`` = e sbh
(2sbh, divided by t with SP). The recomputed tensors of one layer are live again during its
backward: ``recompute_transient_bytes``, counted once per stage, not per layer.

Activations of a pipeline stage (``pipeline_activation_bytes``):

    A = (layers in stage x ActivationBytes.total_bytes) x in-flight micro-batches
        + recompute_transient_bytes

with the peak in-flight micro-batches taken from ``cost_models.pipeline`` (p for the first stage
of 1F1B, m for GPipe). Embedding, logits and loss activations are not layer activations and are
not counted here.

Communication buffers C (NCCL buffers, all-gathered FSDP layers, bucketed gradients) come from
the caller. Allocator reserve (``allocator_reserve_bytes``): R = max(fraction x (P + G + O + A +
C), minimum), an estimate of the caching allocator's fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal, get_args

Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd_momentum"]
Recompute = Literal["none", "selective", "full"]

GIB = 2**30

# Bytes per parameter of the weights used by forward and backward, and of their gradients
# (ZeRO sec 3.1: fp16 parameters and gradients under mixed precision).
_WEIGHT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer moments per parameter: Adam/AdamW keep momentum and variance (Kingma & Ba 2015;
# Loshchilov & Hutter 2019), SGD with momentum one buffer, plain SGD none; fp32 (4 bytes) unless
# a stack keeps them narrower (``moment_bytes``).
MOMENTS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
# fp32 master weights kept by mixed-precision training (ZeRO sec 3.1; Micikevicius et al. 2018).
MASTER_WEIGHT_BYTES = 4
# Dropout masks are stored as one byte per element (Korthikanti et al. 2022, sec 4.1).
_DROPOUT_MASK_BYTES = 1
# FlashAttention-2 saves one fp32 log-sum-exp per query row and head (Dao 2023, Alg. 1).
_SOFTMAX_STAT_BYTES = 4
# Allocator reserve: an ESTIMATE, not a calibration. ZeRO sec 3.2 reports out-of-memory errors
# with over 30% of memory still free in extreme cases of fragmentation; PyTorch's caching
# allocator packs 1-10 MiB requests into 20 MiB segments (kLargeBuffer) and rounds larger ones
# to 2 MiB (kRoundLarge, c10/cuda/CUDACachingAllocator.cpp), so partly used segments stay
# reserved. 5% of the live bytes, at least 256 MiB, until calibrated against
# torch.cuda.max_memory_reserved() - max_memory_allocated() on a run.
DEFAULT_RESERVE_FRACTION = 0.05
DEFAULT_RESERVE_MINIMUM_BYTES = 256 * 2**20


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:10.3f} GiB"


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class _SumOfTerms:
    """Mixin for the result dataclasses: total_bytes is the sum of the ``*_bytes`` fields (less
    those in _not_summed), and as_text prints every ``*_bytes`` field in GiB."""

    _not_summed: ClassVar[tuple[str, ...]] = ()

    def _byte_fields(self) -> list[str]:
        return [f.name for f in fields(self) if f.name.endswith("_bytes")]  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        summed = [n for n in self._byte_fields() if n not in ("total_bytes", *self._not_summed)]
        object.__setattr__(self, "total_bytes", float(sum(getattr(self, n) for n in summed)))

    def as_text(self) -> str:
        names = [n for n in self._byte_fields() if n not in self._not_summed]
        names += self._not_summed
        width = max(map(len, names))
        return "\n".join(
            f"{n.removesuffix('_bytes'):<{width}}{_gib(getattr(self, n))}"
            + ("  (not in total)" if n in self._not_summed else "")
            for n in names
        )


@dataclass(frozen=True)
class ModelStateBytes(_SumOfTerms):
    """Parameters, gradients and optimizer state on one device; total_bytes is their sum."""

    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    total_bytes: float = field(init=False)


def model_state_bytes(
    num_params: float,
    *,
    precision: Precision,
    optimizer: Optimizer,
    zero_stage: int,
    shard_degree: int,
    moment_bytes: int = 4,
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state per device under ZeRO.

    Args:
        num_params: parameters held by this device before ZeRO sharding (after TP/PP splits).
        precision: dtype of the training weights; bf16/fp16 imply fp32 master weights.
        optimizer: which optimizer's state is kept.
        zero_stage: 0 none, 1 shards optimizer state, 2 also gradients, 3 also parameters.
        shard_degree: number of ranks the ZeRO stage shards over.
        moment_bytes: bytes per element of each optimizer moment: 4 (fp32), 2 where they are
            kept in BF16 (Megatron-Core's precision-aware optimizer), 1 (8-bit Adam).

    Returns:
        ModelStateBytes.

    Raises:
        ValueError: unknown precision or optimizer, zero_stage outside 0..3, shard_degree < 1,
            negative num_params, moment_bytes not 1, 2 or 4.

    >>> model_state_bytes(7.5e9, precision="bf16", optimizer="adam", zero_stage=0,
    ...                   shard_degree=64).total_bytes / 1e9
    120.0
    """
    _check_choice("precision", precision, get_args(Precision))
    _check_choice("optimizer", optimizer, get_args(Optimizer))
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3")
    _check_positive(shard_degree=shard_degree)
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if moment_bytes not in (1, 2, 4):
        raise ValueError(f"moment_bytes must be 1, 2 or 4, got {moment_bytes}")
    weight = _WEIGHT_BYTES[precision]
    master = MASTER_WEIGHT_BYTES if precision != "fp32" else 0
    optimizer_per_param = master + MOMENTS[optimizer] * moment_bytes

    def shard(stage: int) -> int:
        return shard_degree if zero_stage >= stage else 1

    return ModelStateBytes(
        parameters_bytes=weight * num_params / shard(3),
        gradients_bytes=weight * num_params / shard(2),
        optimizer_bytes=optimizer_per_param * num_params / shard(1),
    )


@dataclass(frozen=True)
class ActivationBytes(_SumOfTerms):
    """Activations one transformer layer keeps from its forward to its backward, per device.

    attention_scores_bytes holds the s^2 tensors, the attention-probability dropout mask
    included (softmax statistics with flash attention); dropout_mask_bytes holds the two
    hidden-sized masks. recompute_transient_bytes is live only during one layer's backward and
    is not part of total_bytes.
    """

    attention_bytes: float
    attention_scores_bytes: float
    mlp_bytes: float
    layer_norm_bytes: float
    dropout_mask_bytes: float
    saved_input_bytes: float
    recompute_transient_bytes: float
    recompute: Recompute
    total_bytes: float = field(init=False)

    _not_summed: ClassVar[tuple[str, ...]] = ("recompute_transient_bytes",)

    def as_text(self) -> str:
        return f"activations per layer (recompute={self.recompute})\n" + super().as_text()


def transformer_layer_activation_bytes(
    *,
    seq_len: int,
    micro_batch_size: int,
    hidden: int,
    num_heads: int,
    ffn_hidden: int | None = None,
    num_kv_heads: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    recompute: Recompute = "none",
    bytes_per_element: float = 2,
    dropout: bool = True,
    flash_attention: bool = False,
    gated_mlp: bool = False,
) -> ActivationBytes:
    """Activation bytes one transformer layer keeps per device (see the module docstring).

    Args:
        seq_len, micro_batch_size, hidden, num_heads: s, b, h, a of the paper.
        ffn_hidden: MLP inner size f; None means 4 * hidden.
        num_kv_heads: key/value heads k (GQA/MQA); None means num_heads.
        tp, sequence_parallel, cp: tensor-parallel degree, Megatron sequence parallelism over
            the TP group, context-parallel degree.
        recompute: "none", "selective" (core attention) or "full" (whole layer).
        bytes_per_element: bytes of one activation element (2 for bf16/fp16).
        dropout, flash_attention, gated_mlp: see the module docstring.

    Returns:
        ActivationBytes with the per-term breakdown.

    Raises:
        ValueError: a size < 1, an unknown recompute policy, num_heads not divisible by tp or
            num_kv_heads, seq_len not divisible by cp (and by cp * tp with sequence_parallel).

    >>> a = transformer_layer_activation_bytes(seq_len=2048, micro_batch_size=1, hidden=12288,
    ...                                        num_heads=96)
    >>> a.total_bytes / (2048 * 12288)  # 34 + 5as/h
    114.0
    """
    ffn = 4 * hidden if ffn_hidden is None else ffn_hidden
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_activation_args(
        sequence_parallel,
        recompute,
        bytes_per_element,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn,
        num_kv_heads=kv_heads,
        tp=tp,
        cp=cp,
    )
    e, b = bytes_per_element, micro_batch_size
    s = seq_len / cp  # queries, keys and values kept by this CP rank
    sbh = s * b * hidden
    outside = tp if sequence_parallel else 1  # divisor of tensors outside the TP region
    mask = _DROPOUT_MASK_BYTES if dropout else 0
    kv_per_rank = math.ceil(kv_heads / tp)  # fewer kv heads than tp: replicated, one per rank
    if flash_attention:
        scores = _SOFTMAX_STAT_BYTES * (num_heads / tp) * s * b
    else:
        per_score = e + (mask + e if dropout else 0)  # softmax out [, mask, dropout out]
        scores = per_score * (num_heads / tp) * s * seq_len * b
    stored = {
        "attention_bytes": e * sbh / outside
        + 2 * e * sbh / tp
        + 2 * e * sbh * kv_per_rank / num_heads,
        "attention_scores_bytes": scores,
        "mlp_bytes": e * sbh / outside + (3 if gated_mlp else 2) * e * s * b * ffn / tp,
        "layer_norm_bytes": 2 * e * sbh / outside,
        "dropout_mask_bytes": 2 * mask * sbh / outside,
    }
    dropped = {"none": (), "selective": ("attention_scores_bytes",), "full": tuple(stored)}
    return ActivationBytes(
        **{name: 0.0 if name in dropped[recompute] else v for name, v in stored.items()},
        saved_input_bytes=e * sbh / outside if recompute == "full" else 0.0,
        recompute_transient_bytes=sum(stored[name] for name in dropped[recompute]),
        recompute=recompute,
    )


def _check_activation_args(
    sequence_parallel: bool, recompute: str, bytes_per_element: float, **sizes: int
) -> None:
    _check_positive(**sizes)
    _check_choice("recompute", recompute, get_args(Recompute))
    if bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be > 0, got {bytes_per_element}")
    seq_len, heads, kv_heads = sizes["seq_len"], sizes["num_heads"], sizes["num_kv_heads"]
    tp, cp = sizes["tp"], sizes["cp"]
    if heads % tp:
        raise ValueError(f"num_heads={heads} is not divisible by tp={tp}")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not divisible by num_kv_heads={kv_heads}")
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={cp}")
    if sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(
            f"seq_len / cp = {seq_len // cp} is not divisible by tp={tp} (sequence_parallel)"
        )


def pipeline_activation_bytes(
    per_microbatch_stage_bytes: float, inflight_microbatches: float
) -> float:
    """Peak activation bytes of a pipeline stage: one micro-batch's bytes x those in flight.

    Args:
        per_microbatch_stage_bytes: activations one micro-batch leaves on this stage (its
            layers' ActivationBytes.total_bytes summed).
        inflight_microbatches: peak number of micro-batches whose forward ran and whose backward
            has not, from the schedule simulation in cost_models.pipeline (p on the first stage
            of 1F1B, m for GPipe; fractional for interleaved chunks counted in whole stages).

    Returns:
        Bytes. Add ActivationBytes.recompute_transient_bytes once on top.

    Raises:
        ValueError: a negative argument.

    >>> pipeline_activation_bytes(2.0e9, 4)
    8000000000.0
    """
    if per_microbatch_stage_bytes < 0 or inflight_microbatches < 0:
        raise ValueError(
            f"per_microbatch_stage_bytes={per_microbatch_stage_bytes} and "
            f"inflight_microbatches={inflight_microbatches} must both be >= 0"
        )
    return float(per_microbatch_stage_bytes * inflight_microbatches)


def allocator_reserve_bytes(
    total_bytes: float,
    *,
    fraction: float = DEFAULT_RESERVE_FRACTION,
    minimum_bytes: float = DEFAULT_RESERVE_MINIMUM_BYTES,
) -> float:
    """Bytes to keep free for the caching allocator's fragmentation (an estimate).

    Args:
        total_bytes: live bytes the plan needs (model state, activations, buffers).
        fraction: share of total_bytes reserved; see DEFAULT_RESERVE_FRACTION for its source.
        minimum_bytes: floor of the reserve.

    Returns:
        max(fraction * total_bytes, minimum_bytes).

    Raises:
        ValueError: a negative argument.

    >>> allocator_reserve_bytes(100 * 2**30) / 2**30
    5.0
    """
    if total_bytes < 0 or fraction < 0 or minimum_bytes < 0:
        raise ValueError(
            f"total_bytes={total_bytes}, fraction={fraction} and minimum_bytes={minimum_bytes} "
            "must all be >= 0"
        )
    return float(max(fraction * total_bytes, minimum_bytes))


@dataclass(frozen=True)
class PeakMemory(_SumOfTerms):
    """Peak memory of one device by term; total_bytes is their sum."""

    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    communication_buffer_bytes: float
    reserve_bytes: float
    total_bytes: float = field(init=False)


def peak_memory(
    model_state: ModelStateBytes,
    *,
    activation_bytes: float,
    communication_buffer_bytes: float = 0.0,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    reserve_minimum_bytes: float = DEFAULT_RESERVE_MINIMUM_BYTES,
) -> PeakMemory:
    """PeakMemory from the model state, activations and buffers, with the allocator reserve.

    >>> state = ModelStateBytes(2 * 2**30, 2 * 2**30, 12 * 2**30)
    >>> peak_memory(state, activation_bytes=4 * 2**30).total_bytes / 2**30
    21.0
    """
    live = model_state.total_bytes + activation_bytes + communication_buffer_bytes
    return PeakMemory(
        parameters_bytes=model_state.parameters_bytes,
        gradients_bytes=model_state.gradients_bytes,
        optimizer_bytes=model_state.optimizer_bytes,
        activation_bytes=activation_bytes,
        communication_buffer_bytes=communication_buffer_bytes,
        reserve_bytes=allocator_reserve_bytes(
            live, fraction=reserve_fraction, minimum_bytes=reserve_minimum_bytes
        ),
    )
