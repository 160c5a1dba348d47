"""Tests of cost_models.memory against the ZeRO and Korthikanti et al. 2022 papers.

Paper symbols: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree.
"""

from __future__ import annotations

import doctest

import pytest

from cost_models import memory
from cost_models.memory import (
    ModelStateBytes,
    PeakMemory,
    allocator_reserve_bytes,
    model_state_bytes,
    peak_memory,
    pipeline_activation_bytes,
    transformer_layer_activation_bytes,
)

GB = 1e9  # the ZeRO paper's figures are in decimal GB

# ---------------------------------------------------------------- model state (ZeRO)

# ZeRO (Rajbhandari et al. 2020) Figure 1: 7.5B parameters, Nd = 64, K = 12, mixed-precision
# Adam. Printed to one decimal, so the tolerance is half a unit of the last printed digit
# (stage 3's exact 16 * 7.5 / 64 = 1.875 GB prints as 1.9).
ZERO_FIGURE_1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("zero_stage, expected_gb", sorted(ZERO_FIGURE_1_GB.items()))
def test_zero_figure_1(zero_stage: int, expected_gb: float) -> None:
    state = model_state_bytes(
        7.5e9, precision="fp16", optimizer="adam", zero_stage=zero_stage, shard_degree=64
    )
    assert state.total_bytes / GB == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_zero_closed_form(zero_stage: int) -> None:
    # ZeRO sec 5: (2 + 2 + K) Psi, 2 Psi + 2 Psi + K Psi / N, 2 Psi + (2 + K) Psi / N,
    # (2 + 2 + K) Psi / N.
    psi, n, k = 7.5e9, 64, 12
    expected = {
        0: (2 + 2 + k) * psi,
        1: 4 * psi + k * psi / n,
        2: 2 * psi + (2 + k) * psi / n,
        3: (2 + 2 + k) * psi / n,
    }[zero_stage]
    state = model_state_bytes(
        psi, precision="bf16", optimizer="adamw", zero_stage=zero_stage, shard_degree=n
    )
    assert state.total_bytes == pytest.approx(expected, rel=1e-12)


def test_zero_trillion_on_1024_devices() -> None:
    # ZeRO Table 1: 1T parameters with P_os+g+p on Nd = 1024 need 15.6 GB per device.
    state = model_state_bytes(
        1e12, precision="fp16", optimizer="adam", zero_stage=3, shard_degree=1024
    )
    assert state.total_bytes / GB == pytest.approx(15.6, abs=0.05)


@pytest.mark.parametrize(
    "precision, optimizer, per_param",
    [
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "sgd", (4, 4, 0)),
        ("fp32", "sgd_momentum", (4, 4, 4)),
        ("bf16", "sgd", (2, 2, 4)),
        ("bf16", "sgd_momentum", (2, 2, 8)),
        ("bf16", "adamw", (2, 2, 12)),
    ],
)
def test_bytes_per_parameter(precision: str, optimizer: str, per_param: tuple[int, ...]) -> None:
    state = model_state_bytes(
        10, precision=precision, optimizer=optimizer, zero_stage=0, shard_degree=8
    )
    got = (state.parameters_bytes, state.gradients_bytes, state.optimizer_bytes)
    assert got == tuple(10.0 * p for p in per_param)


def test_zero_stage_shards_cumulatively() -> None:
    def state(stage: int) -> ModelStateBytes:
        return model_state_bytes(
            800, precision="bf16", optimizer="adam", zero_stage=stage, shard_degree=8
        )

    assert (state(1).parameters_bytes, state(1).gradients_bytes, state(1).optimizer_bytes) == (
        1600,
        1600,
        1200,
    )
    assert (state(2).parameters_bytes, state(2).gradients_bytes) == (1600, 200)
    assert state(3).parameters_bytes == 200


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(zero_stage=4), ["zero_stage=4", "0, 1, 2, 3"]),
        (dict(zero_stage=-1), ["zero_stage=-1"]),
        (dict(shard_degree=0), ["shard_degree", "0"]),
        (dict(precision="fp8"), ["'fp8'", "'bf16'", "'fp32'", "'fp16'"]),
        (dict(optimizer="lion"), ["'lion'", "'adamw'", "'sgd_momentum'"]),
    ],
)
def test_model_state_validation(kwargs: dict, words: list[str]) -> None:
    args = dict(precision="bf16", optimizer="adam", zero_stage=1, shard_degree=8) | kwargs
    with pytest.raises(ValueError) as info:
        model_state_bytes(1e9, **args)
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- activations (Korthikanti 2022)

# Table 3 of Korthikanti et al. 2022: (heads a, hidden h); s = 2048, t = 8, b = 1.
PAPER_SHAPES = {"22B": (64, 6144), "175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600)}
S, T, B = 2048, 8, 1


def _table_2(row: str, a: int, h: int) -> float:
    """Table 2 of the paper: activation bytes per transformer layer, s = S, b = B, t = T."""
    sbh, s, t = S * B * h, S, T
    return (
        sbh
        * {
            "no parallelism": 34 + 5 * a * s / h,
            "tp": 10 + 24 / t + 5 * a * s / (h * t),
            "tp+sp": 34 / t + 5 * a * s / (h * t),
            "tp+selective": 10 + 24 / t,
            "tp+sp+selective": 34 / t,
            "full": 2,
            "full+sp": 2 / t,
        }[row]
    )


ROW_ARGS = {
    "no parallelism": dict(),
    "tp": dict(tp=T),
    "tp+sp": dict(tp=T, sequence_parallel=True),
    "tp+selective": dict(tp=T, recompute="selective"),
    "tp+sp+selective": dict(tp=T, sequence_parallel=True, recompute="selective"),
    "full": dict(tp=T, recompute="full"),
    "full+sp": dict(tp=T, sequence_parallel=True, recompute="full"),
}


def _layer(a: int, h: int, **kwargs: object) -> memory.ActivationBytes:
    return transformer_layer_activation_bytes(
        seq_len=S, micro_batch_size=B, hidden=h, num_heads=a, **kwargs
    )


@pytest.mark.parametrize("row", list(ROW_ARGS))
@pytest.mark.parametrize("shape", list(PAPER_SHAPES))
def test_paper_table_2(shape: str, row: str) -> None:
    a, h = PAPER_SHAPES[shape]
    assert _layer(a, h, **ROW_ARGS[row]).total_bytes == pytest.approx(_table_2(row, a, h), rel=0.01)


def test_paper_per_tensor_breakdown() -> None:
    # Sec 4.1: attention 11sbh + 5as^2b, MLP 19sbh, layer norms 4sbh (dropout masks sbh each).
    a, h = PAPER_SHAPES["175B"]
    got = _layer(a, h)
    sbh = S * B * h
    assert got.attention_bytes + got.dropout_mask_bytes / 2 == 11 * sbh
    assert got.attention_scores_bytes == 5 * a * S * S * B
    assert got.mlp_bytes + got.dropout_mask_bytes / 2 == 19 * sbh
    assert got.layer_norm_bytes == 4 * sbh


@pytest.mark.parametrize("shape, reduction", [("175B", 0.70), ("530B", 0.65)])
def test_paper_selective_recompute_reduction(shape: str, reduction: float) -> None:
    # Sec 4.3: selective recomputation saves 70% of activation memory for GPT-3 (175B) and
    # 65% for MT-NLG (530B).
    a, h = PAPER_SHAPES[shape]
    full = _layer(a, h, tp=T, sequence_parallel=True).total_bytes
    selective = _layer(a, h, tp=T, sequence_parallel=True, recompute="selective").total_bytes
    assert 1 - selective / full == pytest.approx(reduction, abs=0.005)


@pytest.mark.parametrize("shape", list(PAPER_SHAPES))
def test_paper_about_5x_over_tp_baseline(shape: str) -> None:
    # Abstract: sequence parallelism with selective recomputation "reduces activation memory
    # by 5x" against the tensor-parallel baseline (4.9x to 6.2x over the Table 3 shapes).
    a, h = PAPER_SHAPES[shape]
    baseline = _layer(a, h, tp=T).total_bytes
    ours = _layer(a, h, tp=T, sequence_parallel=True, recompute="selective").total_bytes
    assert 4.9 <= baseline / ours <= 6.3


# ---------------------------------------------------------------- generalised knobs

A, H = PAPER_SHAPES["175B"]


def test_defaults_match_explicit_values() -> None:
    assert _layer(A, H) == _layer(A, H, ffn_hidden=4 * H, num_kv_heads=A)


def test_gqa_shrinks_k_and_v() -> None:
    mha, gqa = _layer(A, H), _layer(A, H, num_kv_heads=8)
    sbh = S * B * H
    assert gqa.total_bytes < mha.total_bytes
    assert mha.attention_bytes - gqa.attention_bytes == pytest.approx(2 * 2 * sbh * (1 - 8 / A))


def test_gqa_with_fewer_kv_heads_than_tp_replicates_one_per_rank() -> None:
    one_each = _layer(A, H, tp=8, num_kv_heads=8)
    assert _layer(A, H, tp=8, num_kv_heads=4) == one_each
    assert _layer(A, H, tp=8, num_kv_heads=1) == one_each


def test_no_dropout_drops_masks_and_dropout_output() -> None:
    with_dropout, without = _layer(A, H), _layer(A, H, dropout=False)
    assert without.dropout_mask_bytes == 0
    assert without.attention_scores_bytes == 2 * A * S * S * B  # softmax output only
    assert with_dropout.total_bytes - without.total_bytes == 2 * S * B * H + 3 * A * S * S * B


def test_flash_attention_keeps_only_softmax_statistics() -> None:
    long = dict(seq_len=32768, micro_batch_size=1, hidden=H, num_heads=A)
    eager = transformer_layer_activation_bytes(**long)
    flash = transformer_layer_activation_bytes(**long, flash_attention=True)
    assert flash.attention_scores_bytes == 4 * A * 32768  # one fp32 log-sum-exp per row and head
    assert flash.total_bytes < eager.total_bytes / 20
    assert flash.attention_bytes == eager.attention_bytes


def test_gated_mlp_keeps_three_ffn_tensors() -> None:
    f = 8 * H // 3
    plain = _layer(A, H, ffn_hidden=f)
    gated = _layer(A, H, ffn_hidden=f, gated_mlp=True)
    assert gated.mlp_bytes - plain.mlp_bytes == 2 * S * B * f


def test_bytes_per_element_scales_all_but_masks() -> None:
    half, full = _layer(A, H), _layer(A, H, bytes_per_element=4)
    assert full.mlp_bytes == 2 * half.mlp_bytes
    assert full.dropout_mask_bytes == half.dropout_mask_bytes


def test_context_parallel_divides_sequence() -> None:
    one, four = (
        _layer(A, H, tp=T, sequence_parallel=True),
        _layer(A, H, tp=T, sequence_parallel=True, cp=4),
    )
    assert four.attention_scores_bytes == pytest.approx(one.attention_scores_bytes / 4)
    assert four.mlp_bytes == pytest.approx(one.mlp_bytes / 4)
    assert four.total_bytes == pytest.approx(one.total_bytes / 4)
    flash_one = _layer(A, H, cp=1, flash_attention=True)
    flash_four = _layer(A, H, cp=4, flash_attention=True)
    assert flash_four.attention_scores_bytes == pytest.approx(flash_one.attention_scores_bytes / 4)


def test_full_recompute_keeps_input_and_rematerialises_one_layer() -> None:
    plain = _layer(A, H, tp=T, sequence_parallel=True)
    full = _layer(A, H, tp=T, sequence_parallel=True, recompute="full")
    assert full.total_bytes == full.saved_input_bytes == 2 * S * B * H / T
    assert full.recompute_transient_bytes == plain.total_bytes


def test_selective_recompute_transient_is_the_scores() -> None:
    plain = _layer(A, H, tp=T)
    selective = _layer(A, H, tp=T, recompute="selective")
    assert selective.attention_scores_bytes == 0
    assert selective.recompute_transient_bytes == plain.attention_scores_bytes


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=5), ["num_heads=96", "tp=5"]),
        (dict(num_kv_heads=7), ["num_heads=96", "num_kv_heads=7"]),
        (dict(cp=3), ["seq_len=2048", "cp=3"]),
        (dict(seq_len=2052, tp=8, sequence_parallel=True), ["2052", "tp=8"]),
        (dict(recompute="some"), ["'some'", "'selective'", "'full'"]),
        (dict(hidden=0), ["hidden", "0"]),
        (dict(bytes_per_element=0), ["bytes_per_element"]),
    ],
)
def test_activation_validation(kwargs: dict, words: list[str]) -> None:
    args = dict(seq_len=S, micro_batch_size=B, hidden=H, num_heads=A) | kwargs
    with pytest.raises(ValueError) as info:
        transformer_layer_activation_bytes(**args)
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- pipeline, reserve, peak


def test_pipeline_activation_bytes() -> None:
    assert pipeline_activation_bytes(3.0e9, 8) == 24.0e9
    assert pipeline_activation_bytes(3.0e9, 0) == 0.0
    with pytest.raises(ValueError, match="inflight_microbatches=-1"):
        pipeline_activation_bytes(1.0, -1)


def test_allocator_reserve() -> None:
    assert allocator_reserve_bytes(100 * 2**30) == 5 * 2**30
    assert allocator_reserve_bytes(0) == memory.DEFAULT_RESERVE_MINIMUM_BYTES
    assert allocator_reserve_bytes(100.0, fraction=0.1, minimum_bytes=0) == 10.0
    with pytest.raises(ValueError, match="fraction=-0.1"):
        allocator_reserve_bytes(1.0, fraction=-0.1)


def test_peak_memory_sums_terms() -> None:
    state = model_state_bytes(
        7.5e9, precision="bf16", optimizer="adam", zero_stage=1, shard_degree=64
    )
    peak = peak_memory(state, activation_bytes=10 * 2**30, communication_buffer_bytes=2**30)
    live = state.total_bytes + 11 * 2**30
    assert peak.reserve_bytes == pytest.approx(0.05 * live)
    assert peak.total_bytes == pytest.approx(1.05 * live)
    assert isinstance(peak, PeakMemory)
    text = peak.as_text()
    for name in (
        "parameters",
        "gradients",
        "optimizer",
        "activation",
        "communication_buffer",
        "reserve",
        "total",
    ):
        assert name in text
    assert text.count("GiB") == 7


def test_results_are_frozen_and_print() -> None:
    layer = _layer(A, H)
    with pytest.raises(AttributeError):
        layer.total_bytes = 0.0  # type: ignore[misc]
    assert "recompute=none" in layer.as_text()
    assert (
        "GiB"
        in model_state_bytes(
            1e9, precision="bf16", optimizer="adam", zero_stage=0, shard_degree=1
        ).as_text()
    )


def test_docstring_examples() -> None:
    assert doctest.testmod(memory).failed == 0
