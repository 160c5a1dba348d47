"""Compute time of one op on one device: a roofline with size-dependent efficiency.

For an op of class c with F FLOPs moving M bytes on a device with dtype peak P, memory bandwidth W
and launch overhead t0:

    time = t0 + max(F / (P_c * eff_c(F)), M / (W * eff_mem(M)))            (op_time_s)

    eff(x) = e_max * x / (x + x_half)                                    (EfficiencyCurve.at)

P_c is the dtype's tensor-core peak for matmul and attention, and the fp32 (vector) peak for
elementwise and reduction ops, whose arithmetic does not run on tensor cores. An fp32 matmul on
a GPU (TF32 off) runs on the vector units too, where a device may reach another fraction of
that peak over a shorter ramp than its tensor-core GEMMs: its own curve where the profile gives
one (`DeviceSpec.matmul_fp32`), else the matmul curve; so does fp32 attention, whose products
are such GEMMs, never faster than the tensor-core kernels in bf16 (`DeviceSpec.attention_s`).
eff rises from 0 towards e_max, reaching e_max/2 at x_half: so
F / (P * eff(F)) = (F + x_half) / (P * e_max), a fixed cost plus a rate, which is how small
GEMMs and short messages behave in practice.

A collective called with a list of n per-rank views (torch.distributed.all_gather(list, x),
reduce_scatter(y, list)) makes torch's ProcessGroupNCCL copy the flat buffer to or from each
view (its allgather copies outputFlattened[j] to each output after the NCCL call, its
reduce_scatter flattens the input list before it): n copy kernels of S/n bytes on the
collective's stream. The host spends t0 issuing each; the device m = op_time_s(elementwise,
2 S / n bytes) - t0 running each. With T the collective itself (`list_collective_time_s`):

    all-gather (copies after T, issued while T runs)   max(T + n m, n t0 + m)
    reduce-scatter (copies before T)                   n max(t0, m) + m + T
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# mxfp8 / nvfp4: Blackwell's block-scaled tensor-core formats (their own rates)
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]
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
    # fp32 GEMMs on the vector units (a GPU's CUDA cores, TF32 off), where measured: V100's
    # SGEMM reaches 0.89 of its fp32 peak where its tensor-core HGEMM reaches 0.76, and an
    # H200's fp32 GEMM ramps up over 1/24 of the FLOPs its BF16 GEMM needs (its rate is 1/15)
    matmul_fp32: EfficiencyCurve | None = None

    def matmul_curve(self, dtype: str) -> EfficiencyCurve:
        """The efficiency curve of a matmul in ``dtype``: `matmul_fp32` for fp32 where given."""
        if dtype == "fp32" and self.matmul_fp32 is not None:
            return self.matmul_fp32
        return self.matmul

    def attention_s(self, flops: float, dtype: str) -> float:
        """Compute time of an attention op of ``flops`` in ``dtype``: on the `attention` curve
        at the dtype's peak; in fp32, on a device with a curve for fp32 GEMMs on its vector
        units (`matmul_fp32`), at that curve and the fp32 peak -- no tensor-core kernel takes
        fp32, so the score and value products run as those GEMMs do (an eager attention's
        batched matmuls, or the fp32 path of a fused kernel) -- but never faster than the
        tensor-core kernels run it in bf16 (their ramp is the longer one: a small fp32
        attention is not priced under its bf16 twin)."""
        if dtype != "fp32" or self.matmul_fp32 is None:
            return flops / (self.peak(dtype) * self.attention.at(flops))
        vector = flops / (self.peak("fp32") * self.matmul_fp32.at(flops))
        return max(vector, flops / (self.peak("bf16") * self.attention.at(flops)))

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
        compute_s = flops / (device.peak(dtype) * device.matmul_curve(dtype).at(flops))
    elif op_class == "attention":
        compute_s = device.attention_s(flops, dtype)
    else:
        # Vector units, not tensor cores: the fp32 peak with the memory curve's shape.
        compute_s = flops / (device.peak("fp32") * device.memory.max)
    memory_s = bytes_moved / (device.memory_bandwidth_bytes_per_s * device.memory.at(bytes_moved))
    return device.launch_overhead_s + max(compute_s, memory_s)


def list_collective_time_s(
    device: DeviceSpec,
    collective_s: float,
    message_bytes: float,
    num_ranks: int,
    *,
    copies_first: bool,
) -> float:
    """One collective on a list of per-rank views, with its n copies (module docstring).

    Args:
        device: the device the copies run on.
        collective_s: T, the collective alone (cost_models.comm).
        message_bytes: S, the whole flat buffer (all-gather output, reduce-scatter input).
        num_ranks: n, views in the list (the group size); one rank copies nothing.
        copies_first: True for reduce-scatter (the input list is flattened before the call),
            False for all-gather (the flat output is copied out after it).

    Returns:
        Seconds from the host's call to the last copy's end.

    Example:
        >>> dev = DeviceSpec("x", 8e10, 1e12, 1e-6, {"bf16": 1e15, "fp32": 5e13},
        ...     EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0), EfficiencyCurve(1.0, 0.0))
        >>> # 4 copies of 2 MB moved: m = 2 us, t0 = 1 us
        >>> round(list_collective_time_s(dev, 1e-5, 4e6, 4, copies_first=False), 9)
        1.8e-05
        >>> round(list_collective_time_s(dev, 1e-5, 4e6, 4, copies_first=True), 9)
        2e-05
    """
    if message_bytes < 0 or num_ranks < 1 or collective_s < 0:
        raise ValueError(
            f"collective_s and message_bytes must be >= 0 and num_ranks >= 1, got "
            f"{collective_s}, {message_bytes}, {num_ranks}"
        )
    if num_ranks == 1:
        return collective_s
    n, t0 = num_ranks, device.launch_overhead_s
    m = op_time_s(device, "elementwise", 0.0, 2 * message_bytes / n, "fp32") - t0
    if copies_first:
        return n * max(t0, m) + m + collective_s
    return max(collective_s + n * m, n * t0 + m)
