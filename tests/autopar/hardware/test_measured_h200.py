"""The shipped H200 numbers against what an H200 measured (data/measurements, 2026-11-30,
`benchmarks/gpu_kernels.py`): its bf16 GEMM ceiling, and fp32 GEMMs on the CUDA cores, which
every profile prices on the one matmul curve."""

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
    at 0.62-0.69 of theirs: one curve for both dtypes prices fp32 no faster than it runs."""
    fp32 = statistics.median(_efficiency("matmul-fp32", LAYER))
    bf16 = statistics.median(_efficiency("matmul", LAYER))
    assert fp32 >= bf16, (fp32, bf16)
    assert 0.7 <= fp32 <= 0.8
