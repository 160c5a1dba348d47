"""The shipped H200 numbers against what an H200 measured (data/measurements, 2026-11-30,
`benchmarks/gpu_kernels.py`): its bf16 GEMM ceiling, and fp32 GEMMs on the CUDA cores, which
the Hopper profiles price on a curve of their own (`matmul_fp32`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from autopar.hardware import load_profile

DATA = Path(__file__).resolve().parents[3] / "data" / "measurements"
KERNELS = json.loads((DATA / "h200_kernels_2026-11-30.json").read_text())
END_TO_END = 0.875  # the matmul curve's max is the GEMM ceiling times this (dgx_h200.toml)
LAYER = ("qkv", "o ", "gate_up", "down")  # a Llama 3 8B layer's GEMMs at 8192 tokens


def _efficiency(kernel: str, shapes: tuple[str, ...] = ()) -> list[float]:
    return [
        r["efficiency"]
        for r in KERNELS["rows"]
        if r["kernel"] == kernel and (not shapes or r["shape"].startswith(shapes))
    ]


def test_the_matmul_curve_is_the_measured_bf16_ceiling_times_its_training_factor():
    single = load_profile("dgx_h200").device.matmul.max / END_TO_END
    best = max(_efficiency("matmul"))
    assert abs(single / best - 1) < 0.06, (single, best)


def test_fp32_gemms_reach_the_bf16_share_of_their_own_peak_or_more():
    """A layer's fp32 GEMMs (no tensor cores) ran at 0.74-0.77 of the fp32 peak, its bf16 ones
    at 0.62-0.69 of theirs: the fp32 curve prices them at least at the bf16 share."""
    fp32 = statistics.median(_efficiency("matmul-fp32", LAYER))
    bf16 = statistics.median(_efficiency("matmul", LAYER))
    assert fp32 >= bf16, (fp32, bf16)
    assert 0.7 <= fp32 <= 0.8


def test_the_fp32_curve_is_the_measured_fp32_gemms_times_the_training_factor():
    """`matmul_fp32` against the fp32 GEMMs of 0.1 ms and more (shorter ones time the host):
    each within 7% of the curve over the training factor, and its ramp far shorter in FLOPs
    than the bf16 GEMMs' (the same time at 1/15 of the rate)."""
    device = load_profile("dgx_h200").device
    curve = device.matmul_curve("fp32")
    assert curve is device.matmul_fp32 and curve.half_size < device.matmul.half_size
    rows = [r for r in KERNELS["rows"] if r["kernel"] == "matmul-fp32" and r["seconds"] > 1e-4]
    assert len(rows) >= 6
    for r in rows:
        priced = curve.at(r["x"]) / END_TO_END
        assert abs(priced / r["efficiency"] - 1) < 0.07, (r["shape"], priced, r["efficiency"])
    assert load_profile("dgx_h100").device.matmul_fp32 == curve  # the same die and fp32 peak
