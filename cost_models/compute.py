"""Compute time of one op on one device: a roofline with size-dependent efficiency.

For an op of class c with F FLOPs moving M bytes on a device with dtype peak P, memory bandwidth W
and launch overhead t0:

    time = t0 + max(F / (P_c * eff_c(F)), M / (W * eff_mem(M)))            (op_time_s)

    eff(x) = e_max * x / (x + x_half)                                    (EfficiencyCurve.at)

P_c is the dtype's tensor-core peak for matmul and attention, and the fp32 (vector) peak for
elementwise and reduction ops, whose arithmetic does not run on tensor cores. eff rises from 0
towards e_max, reaching e_max/2 at x_half: so F / (P * eff(F)) = (F + x_half) / (P * e_max), a
fixed cost plus a rate, which is how small GEMMs and short messages behave in practice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
OpClass = Literal["matmul", "attention", "elementwise", "reduction"]
OP_CLASSES = ("matmul", "attention", "elementwise", "reduction")


@dataclass(frozen=True)
class EfficiencyCurve:
    """Achievable fraction of a peak: ``max * x / (x + half_size)``; x in FLOPs or bytes."""

    max: float
    half_size: float

    def __post_init__(self) -> None:
        if not 0 < self.max <= 1:
            raise ValueError(f"efficiency max must be in (0, 1], got {self.max}")
        if self.half_size < 0:
            raise ValueError(f"efficiency half_size must be >= 0, got {self.half_size}")

    def at(self, size: float) -> float:
        if size <= 0:
            return self.max
        return self.max * size / (size + self.half_size)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU rank) as the cost model sees it."""

    name: str
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float
    peak_flops_per_s: Mapping[str, float]
    matmul: EfficiencyCurve
    attention: EfficiencyCurve
    memory: EfficiencyCurve

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; fp16 falls back to bf16 and back, tf32 to fp32."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(DTYPES)}")
        fallbacks = {"fp16": "bf16", "bf16": "fp16", "tf32": "fp32"}
        for key in (dtype, fallbacks.get(dtype)):
            if key in self.peak_flops_per_s:
                return self.peak_flops_per_s[key]
        raise ValueError(
            f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
            f"it has: {', '.join(sorted(self.peak_flops_per_s))}"
        )


def op_time_s(
    device: DeviceSpec, op_class: OpClass, flops: float, bytes_moved: float, dtype: Dtype
) -> float:
    """Predicted time of one op (see the module docstring for the formula).

    Args:
        device: the device it runs on.
        op_class: "matmul", "attention", "elementwise" or "reduction".
        flops: floating-point operations of the op (a multiply-add counts 2).
        bytes_moved: bytes read plus bytes written to device memory.
        dtype: the dtype its arithmetic runs in.

    Returns:
        Seconds.

    Example:
        >>> dev = DeviceSpec("x", 8e10, 1e12, 0.0, {"bf16": 1e15, "fp32": 5e13},
        ...     EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0))
        >>> op_time_s(dev, "matmul", 2e12, 1e9, "bf16")
        0.002
    """
    if op_class not in OP_CLASSES:
        raise ValueError(f"unknown op class {op_class!r}; known: {', '.join(OP_CLASSES)}")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops} and {bytes_moved}")
    if op_class == "matmul":
        compute_s = flops / (device.peak(dtype) * device.matmul.at(flops))
    elif op_class == "attention":
        compute_s = flops / (device.peak(dtype) * device.attention.at(flops))
    else:
        # Vector units, not tensor cores: the fp32 peak with the memory curve's shape.
        compute_s = flops / (device.peak("fp32") * device.memory.max)
    memory_s = bytes_moved / (device.memory_bandwidth_bytes_per_s * device.memory.at(bytes_moved))
    return device.launch_overhead_s + max(compute_s, memory_s)
