"""The shipped H100 numbers against what an H100 measured (data/measurements, 2026-11-26 and
2026-11-27).

The profile's curves were calibrated on published end-to-end runs; the measurement is of the
kernels alone (`benchmarks/gpu_kernels.py`). Each test holds one shipped number against the
measured figure it stands for, with the bound its source states.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

from autopar.config.precision import RECIPES
from autopar.hardware import load_profile

DATA = Path(__file__).resolve().parents[3] / "data" / "measurements"
KERNELS = json.loads((DATA / "h100_kernels_2026-11-26.json").read_text())
PROGRAM = json.loads((DATA / "h100_program_2026-11-26.json").read_text())
PROGRAM_27 = json.loads((DATA / "h100_program_2026-11-27.json").read_text())
GiB = 2**30
# dgx_h100.toml: the matmul curve's max is the single-GEMM maximum times an end-to-end
# training factor fitted on the calibration runs
END_TO_END = 0.875
# and its attention curve's max is the FlashAttention-2 kernel's (SDPA's flash backend, causal,
# both passes) times the factor the published end-to-end runs fitted (2026-11-29)
ATTENTION_END_TO_END = 0.75


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


def test_the_attention_curve_is_sdpas_flash_kernel_at_long_sequences_times_its_training_factor():
    """benchmarks/gpu_kernels.py counts causal attention's lower triangle with the backward at
    2.5x the forward (FlashAttention's backward recomputes the scores); the trace counts the
    same triangle (`autopar.tracing.ops.causal_share`) with the backward at 2x (torch's FLOP
    counter), so a backward measured at efficiency e runs at 0.8 e of the trace's FLOPs. One
    curve prices both passes: 3 / (1 / e_fwd + 2 / e_bwd) in the trace's count, times the
    end-to-end factor the published runs put on it (dgx_h100.toml's source), as the matmul
    curve carries its own."""
    curve = load_profile("dgx_h100").device.attention
    fwd = {r["seq"]: r for r in _rows("attention-flash-fwd") if r["seq"] >= 8192}
    bwd = {r["seq"]: r for r in _rows("attention-flash-bwd") if r["seq"] >= 8192}
    assert fwd and set(fwd) == set(bwd)
    for seq, f in fwd.items():
        kernel = 3 / (1 / f["efficiency"] + 2 / (0.8 * bwd[seq]["efficiency"]))
        priced = curve.max * f["x"] / (f["x"] + curve.half_size)
        assert abs(priced / (kernel * ATTENTION_END_TO_END) - 1) < 0.1, (seq, priced, kernel)


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


@functools.cache
def _setup(model_json: str) -> tuple:
    """(model, graph, cluster, global batch) of a measurement file's "model", traced once for
    every test that prices its cases."""
    import autopar
    from autopar.hardware import Cluster
    from autopar.models import zoo

    setup = json.loads(model_json)
    kwargs = dict(setup["kwargs"])
    name = kwargs.pop("name")
    model = zoo.build(name, device="meta", **kwargs)
    graph = autopar.trace(model, zoo.example_inputs(name, model))
    cluster = Cluster.from_profile(setup["profile"], num_devices=setup["num_devices"])
    return model, graph, cluster, setup["global_batch_size"]


def _priced(program: dict, cases: list[dict]) -> list:
    """Each case of ``program`` priced by today's estimator at its config, precision and
    stack."""
    import autopar
    from autopar.config import ParallelConfig

    model, graph, cluster, batch = _setup(json.dumps(program["model"], sort_keys=True))
    return [
        autopar.evaluate(
            model,
            cluster,
            ParallelConfig(**case["config"]),
            global_batch_size=batch,
            graph=graph,
            precision=case["precision"],
            stack=case["stack"],
        )
        for case in cases
    ]


def test_what_ran_is_priced_to_fit_and_what_ran_out_of_memory_is_not():
    """The last run is of the runtime as it is now, each case priced again by the estimator
    of today (the file's own figures are those of the day): each case that ran is priced at
    least at the most its allocator reserved (5% slack), and each that ran out of memory
    over the device."""
    cases = PROGRAM["runs"][-1]["cases"]
    for case, plan in zip(cases, _priced(PROGRAM, cases), strict=True):
        peak, capacity = plan.peak_memory_bytes / GiB, plan.memory_capacity_bytes / GiB
        if case["status"] == "ok":
            assert case["reserved_peak_gib"] <= peak * 1.05, (case["case"], peak)
            assert peak <= capacity
        else:
            assert case["status"] == "out of memory" and peak > capacity, (case["case"], peak)


def test_the_live_bytes_priced_are_the_allocators_peak_on_an_h100():
    """2026-11-27, cases around the device's memory: each eager BF16 case that ran is priced,
    less its allocator reserve, within 3% of the most bytes its allocator held at once (0.0 to
    0.1% on the day: the loss's peak and a recomputed block's never summed, no gradient at the
    loss's peak of a step of one micro-batch, the norms' fp32 inputs at fp32's width; before,
    the micro-batch of 16 with full recompute was priced 12.8% over and the others 2% under);
    the compiled and FP8 ones not under it; each that ran priced at least at what its
    allocator reserved (5% slack); each that ran out of memory over the device.

    Not asserted: that each case that ran is priced to fit. The micro-batch of 16 is priced
    with a reserve of its largest tensor, an fp32 logit tensor of 15.7 GiB, over the device
    (82.4 GiB of 77.9), where its allocator held 7.6 GiB reserved and unused (74.3 in all)."""
    cases = [c for run in PROGRAM_27["runs"] for c in run["cases"]]
    for case, plan in zip(cases, _priced(PROGRAM_27, cases), strict=True):
        peak, capacity = plan.peak_memory_bytes / GiB, plan.memory_capacity_bytes / GiB
        if case["status"] != "ok":
            assert case["status"] == "out of memory" and peak > capacity, (case["case"], peak)
            continue
        live = (peak * GiB - plan.stages[0].memory_bytes["reserve"]) / GiB
        measured = case["allocated_peak_gib"]
        if case["precision"] == "bf16" and case["stack"] == "autopar":
            assert abs(measured / live - 1) <= 0.03, (case["case"], measured, live)
        else:
            assert measured <= live * 1.03, (case["case"], measured, live)
        assert case["reserved_peak_gib"] <= peak * 1.05, (case["case"], peak)


def test_eager_fp8_is_priced_at_its_measured_step_and_auto_keeps_bf16_there():
    """2026-11-27: the generated program's eager torchao FP8 linears ran the 1.5 B Llama's step
    in 1.860 s, 2.2x its BF16 step (0.843 s), where the GEMMs and casts alone price 0.746 s:
    the device waits on the host's op-by-op dispatch of the scaling
    (`CostOptions.recipe_host_s`). Priced within 10% now (the BF16 pick too: +6.6% on the
    day, -8.7% since causal attention is counted at its lower triangle, 2026-11-29: the
    doubled count had hidden this 1.5 B model's small-work time, which the cost model does
    not yet price, issue 46; FP8 +0.7%), and `precision="auto"` on the eager stack keeps
    BF16 for this model (it chose FP8 before, for a step 2.2x slower)."""
    import autopar

    by_case = {c["case"]: c for run in PROGRAM_27["runs"] for c in run["cases"]}
    cases = [by_case["fp8"], by_case["pick"]]
    for case, plan in zip(cases, _priced(PROGRAM_27, cases), strict=True):
        assert abs(plan.step_time_s / case["measured_step_s_median"] - 1) <= 0.10, (
            case["case"],
            plan.step_time_s,
        )
    model, graph, cluster, batch = _setup(json.dumps(PROGRAM_27["model"], sort_keys=True))
    auto = autopar.parallelize(
        model, cluster, global_batch_size=batch, precision="auto", graph=graph
    )
    assert auto.precision == "bf16", auto.notes
