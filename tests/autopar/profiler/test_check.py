"""The probe that tells whether a CPU profile describes this machine (`profiler.check`).

The ops are timed once per test and priced on profiles that differ by known factors, so the
assertions are on the pricing and the verdict, never on how fast this machine is.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.errors import ProfileError
from autopar.profiler.check import (
    Probe,
    measure_probes,
    mismatch_note,
    price_probes,
    probe_profile,
)


@pytest.fixture(scope="module")
def measured():
    return measure_probes()


NAMES = ["launch (1-element add)", "matmul fp32 512^3", "matmul bf16 128^3", "copy 32 MiB"]


@pytest.mark.parametrize(
    "which, field",
    [(2, "bf16"), (1, "fp32"), (3, "memory"), (0, "launch")],
)
def test_each_probe_prices_what_it_is_named_for(measured, which, field):
    """A profile 4x faster in one rate (or with a quarter of the launch overhead) prices its
    own probe at least 2.5x cheaper -- the op sits where that rate sets its time -- and moves
    no other probe's price by more than 10%."""
    device = autopar.load_profile("local_cpu").device
    if field == "launch":
        fast = replace(device, launch_overhead_s=device.launch_overhead_s / 4)
    elif field == "memory":
        fast = replace(device, memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s * 4)
    else:
        peaks = dict(device.peak_flops_per_s)
        peaks[field] *= 4
        fast = replace(device, peak_flops_per_s=peaks)
    base, quick = price_probes(device, measured), price_probes(fast, measured)
    assert [p.name for p in base] == NAMES
    for i, (a, b) in enumerate(zip(base, quick, strict=True)):
        assert a.measured_s == b.measured_s > 0
        if i == which:
            assert b.ratio / a.ratio > 2.5, (a, b)
        else:
            assert b.ratio / a.ratio == pytest.approx(1.0, rel=0.1), (a, b)


def test_the_note_names_only_the_probes_off_by_more_than_the_tolerance():
    profile = autopar.load_profile("local_cpu")
    within = [Probe("a", 1.4, 1.0), Probe("b", 1.0, 1.4)]
    assert mismatch_note(profile, within) is None
    off = [*within, Probe("matmul bf16 128^3", 150e-6, 1e-6), Probe("copy", 1.0, 2.0)]
    note = mismatch_note(profile, off)
    assert note and "local_cpu does not describe this machine" in note
    assert "matmul bf16 128^3" in note and "150.00x" in note and "copy" in note
    assert "a:" not in note and "b:" not in note


def test_a_gpu_profile_is_refused_by_name():
    with pytest.raises(ProfileError, match="dgx_h100 is a gpu profile; the probe times CPU"):
        probe_profile(autopar.load_profile("dgx_h100"))
