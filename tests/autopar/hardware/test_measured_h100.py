"""The shipped H100 numbers against what an H100 measured (data/measurements, 2026-11-26).

The profile's curves were calibrated on published end-to-end runs; the measurement is of the
kernels alone (`benchmarks/gpu_kernels.py`). Each test holds one shipped number against the
measured figure it stands for, with the bound its source states.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from autopar.config.precision import RECIPES
from autopar.hardware import load_profile

DATA = Path(__file__).resolve().parents[3] / "data" / "measurements"
KERNELS = json.loads((DATA / "h100_kernels_2026-11-26.json").read_text())
PROGRAM = json.loads((DATA / "h100_program_2026-11-26.json").read_text())
GiB = 2**30
# dgx_h100.toml: the matmul curve's max is the single-GEMM maximum times an end-to-end
# training factor fitted on the calibration runs
END_TO_END = 0.875


def _rows(kernel: str) -> list[dict]:
    return [r for r in KERNELS["rows"] if r["kernel"] == kernel and "rate" in r]


def test_the_matmul_curve_is_the_measured_gemm_maximum_times_its_training_factor():
    best = max(r["efficiency"] for r in _rows("matmul"))
    single = load_profile("dgx_h100").device.matmul.max / END_TO_END
    assert abs(single / best - 1) < 0.05, (single, best)


def test_rowwise_fp8_is_priced_at_its_measured_speed_against_tensorwise():
    tensorwise = {r["shape"]: r for r in _rows("fp8-tensorwise")}
    ratios = [
        r["rate"] / tensorwise[r["shape"]]["rate"]
        for r in _rows("fp8-rowwise")
        if r["x"] >= 2 * 4096**3
    ]
    measured = statistics.median(ratios)
    priced = RECIPES["fp8-rowwise"].gemm_efficiency / RECIPES["fp8-tensorwise"].gemm_efficiency
    assert abs(priced - measured) < 0.02, (priced, measured)


def test_the_attention_curve_is_eager_sdpas_flash_kernel_at_long_sequences():
    curve = load_profile("dgx_h100").device.attention
    for part in ("fwd", "bwd"):
        long = [r for r in _rows(f"attention-flash-{part}") if r["seq"] >= 8192]
        for r in long:
            priced = curve.max * r["x"] / (r["x"] + curve.half_size)
            assert abs(priced / r["efficiency"] - 1) < 0.15, (part, r["shape"], priced)


def test_memory_bytes_fits_inside_what_a_training_process_could_allocate():
    memory = KERNELS["memory"]
    shipped = load_profile("dgx_h100").device.memory_bytes
    assert shipped <= memory["allocated_until_oom_bytes"]  # a bare process's allocator
    outside = [
        case["out_of_memory"]["outside_allocator_gib"]
        for run in PROGRAM["runs"]
        for case in run["cases"]
        if case["out_of_memory"]
    ]
    # a training process keeps the CUDA context and cuBLAS workspaces outside the allocator
    assert shipped <= memory["total_memory_bytes"] - max(outside) * GiB


def test_what_ran_is_priced_to_fit_and_what_ran_out_of_memory_is_not():
    """The last run is of the runtime as it is now, each case priced again by the estimator
    of today (the file's own figures are those of the day): each case that ran is priced at
    least at the most its allocator reserved (5% slack), and each that ran out of memory
    over the device."""
    import autopar
    from autopar.config import ParallelConfig
    from autopar.hardware import Cluster
    from autopar.models import zoo

    setup = PROGRAM["model"]
    kwargs = dict(setup["kwargs"])
    name = kwargs.pop("name")
    model = zoo.build(name, device="meta", **kwargs)
    graph = autopar.trace(model, zoo.example_inputs(name, model))
    cluster = Cluster.from_profile(setup["profile"], num_devices=setup["num_devices"])
    for case in PROGRAM["runs"][-1]["cases"]:
        plan = autopar.evaluate(
            model,
            cluster,
            ParallelConfig(**case["config"]),
            global_batch_size=setup["global_batch_size"],
            graph=graph,
            precision=case["precision"],
            stack=case["stack"],
        )
        peak, capacity = plan.peak_memory_bytes / GiB, plan.memory_capacity_bytes / GiB
        if case["status"] == "ok":
            assert case["reserved_peak_gib"] <= peak * 1.05, (case["case"], peak)
            assert peak <= capacity
        else:
            assert case["status"] == "out of memory" and peak > capacity, (case["case"], peak)
