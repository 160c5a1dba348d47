"""Does a CPU profile still describe this machine? A probe of a second or two.

In: a loaded `HardwareProfile` of kind "cpu". Out: a `Probe` per op -- one-element add
(launch overhead), a 512 x 512 fp32 matmul, a 128 x 128 bf16 matmul, a 32 MiB copy -- with
the seconds measured here, in this process on one thread, and the seconds the profile prices
the same op at (`cost_models.compute.op_time_s`, what the planner charges).

Why: a CPU profile names its CPU by model string, and virtual machines report one string for
different parts ("AMD EPYC" for a Zen 3 and a Zen 4 alike). On 2026-12-01 a Zen 3 reporting
the same name as the shipped local_cpu's Zen 4 measured every local config about twice its
price; its bf16 matmuls ran 150x slower (no bf16 units) and its launch overhead 2-3x. Timing
the ops themselves tells such machines apart where the name cannot. The tolerance is wide
(`TOLERANCE`): the profile was measured with every rank computing at once, this probe runs
alone, and a shared machine's memory copies spread 2x between two runs minutes apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import ProfileError
from autopar.hardware.profile import HardwareProfile
from autopar.profiler.compute import ComputeMeasurement, ComputePlan, copy_op, launch_op, matmul_op
from cost_models.compute import DeviceSpec, op_time_s

# measured / priced beyond this factor either way: the profile is another machine's (or
# this one's on another day); module docstring
TOLERANCE = 1.5
COPY_NUMEL = 2**23  # 32 MiB of fp32: past the caches, so memory bandwidth, not cache


@dataclass(frozen=True)
class Probe:
    name: str
    measured_s: float
    priced_s: float

    @property
    def ratio(self) -> float:
        """Measured over priced: above 1, this machine is slower than the profile says."""
        return self.measured_s / self.priced_s

    @property
    def off(self) -> bool:
        return not 1 / TOLERANCE <= self.ratio <= TOLERANCE

    def as_text(self) -> str:
        return (
            f"{self.name}: {self.measured_s * 1e6:,.1f} us here, priced "
            f"{self.priced_s * 1e6:,.1f} us ({self.ratio:.2f}x)"
        )


def probe_profile(profile: HardwareProfile) -> list[Probe]:
    """Time each probe op on this CPU, one thread, and price it on ``profile``'s device."""
    if profile.kind != "cpu":
        raise ProfileError(f"{profile.name} is a {profile.kind} profile; the probe times CPU ops")
    return price_probes(profile.device, measure_probes())


def measure_probes() -> list[tuple[str, ComputeMeasurement, str]]:
    """(name, measurement, op class) of each probe op, timed here on one thread."""
    device = torch.device("cpu")
    plan = ComputePlan((), (), (), "fp32", target_s=0.05, repeats=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank of `autopar profile` computes
    try:
        return [
            ("launch (1-element add)", launch_op(device, plan), "elementwise"),
            ("matmul fp32 512^3", matmul_op(device, plan, "fp32", 512), "matmul"),
            ("matmul bf16 128^3", matmul_op(device, plan, "bf16", 128), "matmul"),
            ("copy 32 MiB", copy_op(device, plan, COPY_NUMEL), "elementwise"),
        ]
    finally:
        torch.set_num_threads(threads)


def price_probes(
    device: DeviceSpec, measured: list[tuple[str, ComputeMeasurement, str]]
) -> list[Probe]:
    """Each measured probe beside what the cost model charges for it on ``device``."""
    return [Probe(name, m.time_s, priced_s(device, m, op)) for name, m, op in measured]


def priced_s(device: DeviceSpec, m: ComputeMeasurement, op_class: str) -> float:
    """What the cost model charges for the measured op: a copy does no arithmetic."""
    flops = 0.0 if m.op == "copy" else m.flops
    return op_time_s(device, op_class, flops, m.bytes_moved, m.dtype)


def mismatch_note(profile: HardwareProfile, probes: list[Probe]) -> str | None:
    """A line naming the probes off by more than `TOLERANCE`, or None where all are within."""
    off = [p for p in probes if p.off]
    if not off:
        return None
    return (
        f"{profile.name} does not describe this machine now: "
        + "; ".join(p.as_text() for p in off)
        + f" (beyond {TOLERANCE}x either way)"
    )
