"""Roofline compute model."""

from __future__ import annotations

import pytest

from cost_models.compute import DeviceSpec, EfficiencyCurve, list_collective_time_s, op_time_s

DEVICE = DeviceSpec(
    name="test",
    memory_bytes=80e9,
    memory_bandwidth_bytes_per_s=3e12,
    launch_overhead_s=5e-6,
    peak_flops_per_s={"bf16": 1000e12, "fp32": 60e12, "fp8": 2000e12},
    matmul=EfficiencyCurve(0.8, 1e9),
    attention=EfficiencyCurve(0.6, 4e9),
    memory=EfficiencyCurve(0.9, 1e6),
)


def test_efficiency_curve_reaches_half_at_half_size_and_saturates():
    curve = EfficiencyCurve(0.8, 1e9)
    assert curve.at(1e9) == pytest.approx(0.4)
    assert curve.at(1e15) == pytest.approx(0.8, rel=1e-5)
    assert curve.at(1e6) < 0.001


def test_large_matmul_runs_at_max_efficiency():
    flops = 2 * 8192**3  # 1.1e12
    t = op_time_s(DEVICE, "matmul", flops, 3 * 8192**2 * 2, "bf16")
    assert t == pytest.approx(5e-6 + (flops + 1e9) / (1000e12 * 0.8))


def test_small_ops_pay_launch_and_low_efficiency():
    tiny = op_time_s(DEVICE, "matmul", 2 * 64**3, 3 * 64 * 64 * 2, "bf16")
    assert tiny > DEVICE.launch_overhead_s
    assert tiny < 2 * DEVICE.launch_overhead_s


def test_elementwise_is_memory_bound():
    n = 1 << 28
    t = op_time_s(DEVICE, "elementwise", n, 2 * n * 2, "bf16")
    memory_s = 4 * n / (3e12 * DEVICE.memory.at(4 * n))
    assert t == pytest.approx(5e-6 + memory_s)


def test_dtype_changes_matmul_time():
    flops = 1e12
    bf16 = op_time_s(DEVICE, "matmul", flops, 0, "bf16")
    fp8 = op_time_s(DEVICE, "matmul", flops, 0, "fp8")
    assert fp8 < bf16
    # fp16 is not listed: it shares the bf16 tensor-core rate.
    assert op_time_s(DEVICE, "matmul", flops, 0, "fp16") == bf16


def test_fp32_matmuls_take_their_own_curve_where_the_device_gives_one():
    """An fp32 GEMM runs on the vector units: the device's `matmul_fp32` curve prices it, the
    tensor-core dtypes keep the matmul curve, and a device without one prices fp32 on that."""
    from dataclasses import replace

    flops = 1e10
    fp32 = replace(DEVICE, matmul_fp32=EfficiencyCurve(0.9, 1e8))
    assert op_time_s(fp32, "matmul", flops, 0, "fp32") == pytest.approx(
        5e-6 + (flops + 1e8) / (60e12 * 0.9)
    )
    assert op_time_s(DEVICE, "matmul", flops, 0, "fp32") == pytest.approx(
        5e-6 + (flops + 1e9) / (60e12 * 0.8)
    )
    assert op_time_s(fp32, "matmul", flops, 0, "bf16") == op_time_s(
        DEVICE, "matmul", flops, 0, "bf16"
    )


def test_fp32_attention_runs_at_the_fp32_gemms_rate_where_the_device_gives_one():
    """No tensor-core kernel takes fp32, so fp32 attention's products run as fp32 GEMMs do:
    on the device's `matmul_fp32` curve where it has one, never under the tensor-core kernels'
    bf16 time (a small attention, on their longer ramp); the tensor-core dtypes, and a device
    without that curve (a CPU profile, whose attention curve is measured in fp32), keep the
    attention curve at the dtype's peak."""
    from dataclasses import replace

    fp32 = replace(DEVICE, matmul_fp32=EfficiencyCurve(0.9, 1e8))
    large, small = 1e12, 1e6
    assert op_time_s(fp32, "attention", large, 0, "fp32") == pytest.approx(
        op_time_s(fp32, "matmul", large, 0, "fp32")
    )
    assert op_time_s(fp32, "attention", small, 0, "fp32") == op_time_s(
        fp32, "attention", small, 0, "bf16"
    )
    for flops in (small, large):
        assert op_time_s(fp32, "attention", flops, 0, "bf16") == op_time_s(
            DEVICE, "attention", flops, 0, "bf16"
        )
        assert op_time_s(DEVICE, "attention", flops, 0, "fp32") == pytest.approx(
            5e-6 + flops / (60e12 * DEVICE.attention.at(flops))
        )


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'int4'; known dtypes: fp32"):
        op_time_s(DEVICE, "matmul", 1e9, 0, "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no peak FLOP/s for dtype 'tf32'"):
        DeviceSpec("no-tf32", 1, 1, 0, {"bf16": 1.0}, *[EfficiencyCurve(1, 0)] * 3).peak("tf32")
    with pytest.raises(ValueError, match="unknown op class 'conv'"):
        op_time_s(DEVICE, "conv", 1e9, 0, "bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="efficiency max must be in"):
        EfficiencyCurve(1.5, 0)


def test_list_collective_copies_per_rank():
    # 1 TB/s, full efficiency, 5 us launch: 8 views of a 16 MB buffer move 4 MB each (m = 4 us)
    dev = DeviceSpec(
        "round", 8e10, 1e12, 5e-6, {"bf16": 1e15, "fp32": 1e14},
        EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0),
    )  # fmt: skip
    t = 100e-6
    # all-gather: the host issues the 8 copies (40 us) while the collective runs; the device
    # runs them after it: 100 + 8 * 4 us
    assert list_collective_time_s(dev, t, 16e6, 8, copies_first=False) == pytest.approx(132e-6)
    # a short collective: the host's issuing is the bound, 8 * 5 + 4 us
    assert list_collective_time_s(dev, 1e-6, 16e6, 8, copies_first=False) == pytest.approx(44e-6)
    # reduce-scatter: the input list is flattened first: 8 * max(5, 4) + 4 + 100 us
    assert list_collective_time_s(dev, t, 16e6, 8, copies_first=True) == pytest.approx(144e-6)
    assert list_collective_time_s(dev, t, 16e6, 1, copies_first=True) == t
    with pytest.raises(ValueError, match="num_ranks"):
        list_collective_time_s(dev, t, 16e6, 0, copies_first=True)
