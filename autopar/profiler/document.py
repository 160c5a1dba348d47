"""Measurements -> a hardware profile TOML (schema of ``hardware_profiles/README.md``).

In: the compute and communication measurements of one run and a `RunInfo` (date, machine,
software, ranks). Out: the text of a profile that `autopar.hardware.load_profile` reads, whose
numbers are fitted with `cost_models.fit`, and whose ``[measured]`` table keeps every raw point,
so a reader (or a test) can check each fitted number against what produced it.

    launch_overhead_s   time of a one-element add (the `launch` measurement): t0
    peak_flops_per_s.d  fitted large-size rate of dtype d's matmuls (or the best measured rate,
                        if higher), on times less t0: a measured peak, not a datasheet one;
                        sizes that ran faster than the largest are left out (`_rising`)
    efficiency.matmul   one curve fitted to both dtypes' rates, each over its own peak
    efficiency.attention  SDPA forward rates over the peak of the dtype they ran in
    memory bandwidth    as a peak: copy and add, x = bytes moved, less cache-resident sizes
                        (`_rising`); efficiency.memory its curve, the half size
                        capped by every measured size (`_memory_fit`)
    topology.levels[l]  `cost_models.fit.fit_level` on level l's collectives: latency and the
                        achieved bandwidth, efficiency 1
    training factor     with runtime measurements, the three curves' maxima times what a
                        layer's micro-batch grew by from 1 to 4 samples as priced over as
                        measured (`runtime_overhead.training_factor`, `_scaled`)
    runtime             per parallel style, the host time per layer that training through
                        autopar.runtime adds to what the numbers above predict
                        (`autopar.profiler.runtime_overhead`)
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopar.hardware.profile import profile_from_text
from autopar.profiler import runtime_overhead
from autopar.profiler.comm import LevelMeasurement, LevelPlan
from autopar.profiler.compute import ComputeMeasurement
from autopar.profiler.runtime_overhead import RuntimeMeasurement
from cost_models.compute import EfficiencyCurve
from cost_models.fit import CommMeasurement, CurveFit, LevelFit, fit_efficiency_curve, fit_level

# what a curve's source says where the training factor would lift its max over 1
_CAPPED = "capped so that max <= 1"


@dataclass(frozen=True)
class RunInfo:
    name: str  # the profile's name: the output file's stem
    kind: str  # "cpu" or "gpu"
    date: str  # ISO 8601, UTC
    command: str
    machine: str  # "AMD EPYC, 2 cores, 23.4 GiB RAM" or the GPU's name
    num_cores: int
    device_name: str
    memory_bytes: float  # per rank
    torch_version: str
    backend: str
    world_size: int
    ranks_per_node: int
    node_devices: int  # node.devices written: ranks a plan may use per node
    threads_per_rank: int
    wall_s: float


@dataclass(frozen=True)
class Fits:
    launch_overhead_s: float
    peaks: dict[str, CurveFit]  # dtype -> its matmul fit (the peak is .peak)
    matmul: CurveFit
    attention: CurveFit
    attention_dtype: str
    memory: CurveFit
    levels: tuple[LevelFit, ...]


def fit_measurements(
    compute: Sequence[ComputeMeasurement],
    comm: Sequence[LevelMeasurement],
    levels: Sequence[LevelPlan],
) -> Fits:
    """Fit every profile number (module docstring)."""
    t0 = statistics.median(m.time_s for m in compute if m.op == "launch")
    peaks = {}
    sizes, rates = [], []
    for dtype in ("fp32", "bf16"):
        x, r = _rising(*_points(compute, t0, "flops", ops=("matmul",), dtype=dtype))
        peaks[dtype] = fit = _named_fit(f"{dtype} matmul", fit_efficiency_curve, x, r)
        sizes += x
        rates += [v / fit.peak for v in r]
    matmul = _named_fit("matmul", fit_efficiency_curve, sizes, rates, peak=1.0)
    attention_dtype = next(m.dtype for m in compute if m.op == "attention")
    x, r = _points(compute, t0, "flops", ops=("attention",), dtype=attention_dtype)
    peak = peaks[attention_dtype].peak
    attention = _named_fit("attention", fit_efficiency_curve, x, r, peak=peak)
    memory = _named_fit("memory", _memory_fit, compute, t0)
    level_fits = tuple(
        fit_level(
            [
                CommMeasurement(m.collective, m.message_bytes, m.group_size, m.time_s)
                for m in comm
                if m.level == lv.name
            ],
            name=lv.name,
            devices_per_domain=lv.devices_per_domain,
            per_collective=True,
        )
        for lv in levels
    )
    return Fits(t0, peaks, matmul, attention, attention_dtype, memory, level_fits)


def _named_fit(curve: str, fit: Callable[..., CurveFit], *args: Any, **kwargs: Any) -> CurveFit:
    """``fit(*args, **kwargs)``, its refusal naming the ``curve`` it was fitting."""
    try:
        return fit(*args, **kwargs)
    except ValueError as error:
        raise ValueError(f"the {curve} curve: {error}") from error


def _points(
    compute: Sequence[ComputeMeasurement],
    t0: float,
    size: str,
    *,
    ops: tuple[str, ...],
    dtype: str | None = None,
) -> tuple[list[float], list[float]]:
    """(size, rate) of the chosen ops, rates on the time less the launch overhead."""
    sizes, rates = [], []
    for m in compute:
        if m.op in ops and (dtype is None or m.dtype == dtype) and m.time_s > t0:
            x = getattr(m, size)
            sizes.append(x)
            rates.append(x / (m.time_s - t0))
    return sizes, rates


def _rising(sizes: list[float], rates: list[float]) -> tuple[list[float], list[float]]:
    """The points a curve rising with size to one ceiling can express: those no faster than
    1.1x the largest op, and the two largest sizes always, so that there is a slope to fit.

    Smaller ops run faster than larger ones where their data fit in a cache (copy and add),
    and where a CPU without bf16 instructions converts bf16 in software (an AVX2 EPYC on
    2026-11-29: 2.9 GFLOP/s at 64^3, 1.25 at 512^3). Kept, such a point set the bf16 peak at
    1.7x what the large sizes ran, and the curve shared by both dtypes at 0.82 with no rise,
    which priced fp32 20% slow; left out, the curve prices the large ops training runs.
    """
    two_largest = sorted(set(sizes))[-2:]
    ceiling = 1.1 * max(r for x, r in zip(sizes, rates, strict=True) if x == two_largest[-1])
    kept = [(x, r) for x, r in zip(sizes, rates, strict=True) if r <= ceiling or x in two_largest]
    return [x for x, _ in kept], [r for _, r in kept]


def _memory_fit(compute: Sequence[ComputeMeasurement], t0: float) -> CurveFit:
    """The memory curve: its rate from the sizes beyond the caches (`_rising`), its
    half size no larger than any measured copy or add allows.

    The half size is a fixed cost per op, half_size / rate, on top of the launch overhead.
    Fitted on the large sizes alone it is an extrapolation (on local_cpu 2026-11-21: 11.6 MB,
    i.e. 340 us per op, from four points of 134 MB and more), while every smaller op was
    measured: an op of x bytes taking t cannot have a fixed cost above (t - t0) * rate - x,
    so the half size is capped at the smallest such bound over all points (0 where caches
    beat the memory's rate); the rms error is restated for the capped curve.
    """
    sizes, rates = _rising(*_points(compute, t0, "bytes_moved", ops=("copy", "add")))
    fit = fit_efficiency_curve(sizes, rates)
    all_sizes, all_rates = _points(compute, t0, "bytes_moved", ops=("copy", "add"))
    bound = min(max(0.0, x / r * fit.rate - x) for x, r in zip(all_sizes, all_rates, strict=True))
    if bound >= fit.curve.half_size:
        return fit
    curve = EfficiencyCurve(fit.curve.max, bound)
    errors = [(x + bound) / fit.rate / (x / r) - 1 for x, r in zip(sizes, rates, strict=True)]
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    return CurveFit(curve, fit.peak, fit.rate, rms, fit.num_points)


def render(
    info: RunInfo,
    fits: Fits,
    compute: Sequence[ComputeMeasurement],
    comm: Sequence[LevelMeasurement],
    runtime: Sequence[RuntimeMeasurement] = (),
) -> str:
    """The profile's TOML text; with ``runtime`` measurements, its [runtime] overheads, priced
    against the profile the other measurements give (`runtime_overhead.overheads`)."""
    factor = None
    unscaled = fits
    if runtime:
        bare = profile_from_text(render(info, fits, compute, comm), info.name)
        factor = runtime_overhead.training_factor(bare, runtime, info.world_size)
        if factor:
            fits = _scaled(fits, factor)
            bare = profile_from_text(render(info, fits, compute, comm), info.name)
        overheads = runtime_overhead.overheads(bare, runtime, info.world_size)
        optimizer = runtime_overhead.overheads(bare, runtime, info.world_size, "optimizer_s")
        model = runtime_overhead.model_overheads(bare, runtime, info.world_size, overheads)
    else:
        overheads = optimizer = model = {}
    run = (
        f"measured by `{info.command}` on {info.date} ({info.machine}; torch "
        f"{info.torch_version}; {info.world_size} ranks over {info.backend}, "
        f"{info.threads_per_rank} thread(s) each, all measuring at once)"
    )

    def fit_note(fit: CurveFit, bare_fit: CurveFit, what: str) -> str:
        scaled = ""
        if factor:
            # the curve's max is capped at 1 (`_scaled`), so the scale it took is stated: a
            # reader dividing it out gets the fit back
            took = fit.curve.max / bare_fit.curve.max
            capped = f" of {factor:.3f}, {_CAPPED}" if took < factor else ""
            scaled = (
                f", max x {took:.3f}: the training factor{capped}, what a plain layer's "
                f"micro-batch grew by from 1 to {runtime_overhead.TRAINING_BATCH} samples as "
                f"priced over as measured (autopar.profiler.runtime_overhead.training_factor)"
            )
        return f"{run}: {what}; fit {fit.as_text()}{scaled}; raw times in [measured]"

    peaks = fits.peaks
    level_names = ", ".join(f.level.name for f in fits.levels)
    slots = compute_slots(info)
    shared = ""
    if slots:
        shared = (
            f"; {slots} ranks compute at once ({info.num_cores} cores / "
            f"{info.threads_per_rank} thread(s)), more share them (node.compute_slots)"
        )
    lines = [
        f"# {info.name}: autopar hardware profile, schema_version 1 (format: README.md here).",
        f"# Written by `{info.command}`; every number is fitted to the points in [measured].",
        "",
        "schema_version = 1",
        f"name = {_s(info.name)}",
        "description = "
        + _s(
            f"{info.machine}: {info.node_devices} PyTorch ranks per node over {info.backend} "
            f"({level_names}); measured by `autopar profile` on {info.date[:10]} with "
            f"{info.world_size} ranks x {info.threads_per_rank} thread(s){shared}"
        ),
        f"kind = {_s(info.kind)}",
        'spec_device = ""',
        "",
        "[device]",
        f"name = {_s(info.device_name)}",
        f"memory_bytes = {_n(info.memory_bytes)}",
        f"memory_bandwidth_bytes_per_s = {_n(fits.memory.peak)}",
        f"launch_overhead_s = {_n(fits.launch_overhead_s)}",
        "source = "
        + _s(
            f"{run}: memory_bytes = {'RAM / node.devices' if info.kind == 'cpu' else 'device'} "
            f"memory; bandwidth = the memory curve's peak (copy and add, bytes moved over "
            f"time less launch overhead); launch_overhead_s = median time of a one-element add"
        ),
        "",
        "[device.peak_flops_per_s]",
        *(f"{dtype} = {_n(fit.peak)}" for dtype, fit in peaks.items()),
        "source = "
        + _s(
            f"{run}: per dtype the fitted large-size rate of square matmuls "
            + "; ".join(f"{d}: {f.as_text()}" for d, f in peaks.items())
            + "; a measured peak, not a datasheet one"
        ),
        "",
        "# efficiency(x) = max * x / (x + half_size); x = FLOPs of one op (matmul, attention)",
        "# or bytes moved by one op (memory)",
        *_curve(
            "matmul",
            fits.matmul,
            fit_note(
                fits.matmul, unscaled.matmul, "fp32 and bf16 matmul rates over their dtype's peak"
            ),
        ),
        *_curve(
            "attention",
            fits.attention,
            fit_note(
                fits.attention,
                unscaled.attention,
                f"{fits.attention_dtype} scaled_dot_product_attention forward "
                f"(b=1, h=8, d=64) over the {fits.attention_dtype} peak",
            ),
        ),
        *_curve(
            "memory",
            fits.memory,
            fit_note(
                fits.memory,
                unscaled.memory,
                "copy_ and add over bytes moved, less cache-resident sizes (faster "
                "than the largest op by over 10%); half size capped so that no measured "
                "size takes less than the curve's fixed cost",
            ),
        ),
        "",
        "[node]",
        f"devices = {info.node_devices}",
        *([f"compute_slots = {slots}"] if slots else []),
        "source = "
        + _s(
            f"{run}: ranks a plan may use per node (given to `autopar profile --node-devices`; "
            f"{info.ranks_per_node} measured)"
            + (
                "; compute_slots = cores / threads per rank: ranks that compute at once at "
                "the device's rates (a cluster of more per node time-shares them)"
                if slots
                else ""
            )
        ),
        "",
        "# innermost level first; devices_per_domain = 0 is the whole cluster (scale-out)",
    ]
    for fit in fits.levels:
        lv = fit.level
        lines += [
            "[[topology.levels]]",
            f"name = {_s(lv.name)}",
            f"devices_per_domain = {lv.devices_per_domain}",
            f"bandwidth_bytes_per_s = {_n(lv.bandwidth_bytes_per_s)}",
            f"latency_s = {_n(lv.latency_s)}",
            "efficiency = 1.0",
            *(
                [
                    "collective_latency_s = { "
                    + ", ".join(f"{k} = {_n(v)}" for k, v in lv.collective_latency_s)
                    + " }"
                ]
                if lv.collective_latency_s
                else []
            ),
            "source = "
            + _s(
                f"{run}: alpha-beta fitted (cost_models.fit.fit_level) to "
                f"{fit.num_points} timed collectives on this level (all-reduce, all-gather, "
                f"reduce-scatter, all-to-all, send/recv) with cost_models.comm's formulas, "
                f"latency_s shared and collective_latency_s each collective's own (its "
                f"latency-bound points, the shared bandwidth kept), "
                f"typical error x{math.exp(fit.rms_log_ratio):.2f}; predicted / measured, "
                f"median by collective: {_ratios(fit, comm)}; bandwidth is the achieved one, so "
                f"efficiency is 1; raw times in [measured]"
            ),
        ]
    if overheads:
        per_layer = runtime_overhead.measured_per_layer(runtime)
        lines += [
            "",
            "# host time per repeated layer per micro-batch (forward + backward) that training",
            "# through autopar's runtime adds to the op-level model, by parallel style",
            "[runtime]",
            "layer_overhead_s = { "
            + ", ".join(f"{k} = {_n(v)}" for k, v in overheads.items())
            + " }",
            "optimizer_overhead_s = { "
            + ", ".join(f"{k} = {_n(v)}" for k, v in optimizer.items())
            + " }",
            "model_overhead_s = { " + ", ".join(f"{k} = {_n(v)}" for k, v in model.items()) + " }",
            "source = "
            + _s(
                f"{run}: autopar.profiler.runtime_overhead: forward + backward of one "
                f"micro-batch (batch 1) of {runtime_overhead.MODEL} "
                f"({runtime_overhead.model_text()}) at 1 and 3 layers through "
                "autopar.runtime, per style on all ranks (plain = dp, tp / tp_sp = tp 2 with "
                "and without sequence parallelism, fsdp / fsdp3 = FSDP2 ZeRO-2 / ZeRO-3, "
                "selective / full = dp with that recompute, split = dp with the backward in "
                "torch pipelining's input and weight passes); "
                "per layer the 3-layer minus the 1-layer time over 2, less the same "
                "difference of the cost model's prediction from this profile's other "
                "numbers (its compute curves at the training factor where measured), at "
                "least 0; measured per layer: "
                + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in per_layer.items())
                + "; optimizer_overhead_s the same for the step's clipping and AdamW "
                "(foreach=False, as the trainer), per layer per step; model_overhead_s per "
                "micro-batch outside the repeated layers (embedding, head, loss): the 1-layer "
                "time less its prediction and one layer's overhead, at least 0; raw times in "
                "[measured]"
            ),
        ]
    lines += _measured(info, compute, comm, runtime)
    return "\n".join(lines) + "\n"


def _scaled(fits: Fits, factor: float) -> Fits:
    """``fits`` with the matmul, attention and memory curves' maxima times ``factor`` (at
    most 1): the runtime's training factor (`runtime_overhead.training_factor`)."""

    def one(fit: CurveFit) -> CurveFit:
        top = min(1.0, fit.curve.max * factor)
        return replace(fit, curve=replace(fit.curve, max=top), rate=fit.peak * top)

    return replace(
        fits, matmul=one(fits.matmul), attention=one(fits.attention), memory=one(fits.memory)
    )


def compute_slots(info: RunInfo) -> int:
    """Ranks of a CPU node that compute at once at the measured per-rank rates (cores /
    threads per rank); 0 when every device a plan may use has its own (GPUs)."""
    if info.kind != "cpu":
        return 0
    slots = max(1, info.num_cores // max(1, info.threads_per_rank))
    return slots if info.node_devices > slots else 0


def capped_curves(text: str) -> list[str]:
    """The compute curves of a profile written by `render` whose max the training factor
    would have lifted over 1 (`_scaled`): its batch-4 layer grew far less than the ops it
    runs, as when a loaded machine slowed the batch-1 timings."""
    import tomllib

    curves = tomllib.loads(text)["device"]["efficiency"]
    return [op for op in ("matmul", "attention", "memory") if _CAPPED in curves[op]["source"]]


def refit(text: str, name: str) -> str:
    """A profile written by `render`, fitted again from its own [measured] points with this
    version's fits (the measurements, date and machine kept; ``name``: the profile's name)."""
    import tomllib

    data = tomllib.loads(text)
    m = data["measured"]
    compute = [
        ComputeMeasurement(
            r["op"], r["dtype"], r["shape"], r["flops"], r["bytes_moved"], r["time_s"]
        )
        for r in m["compute"]
    ]
    comm = [
        LevelMeasurement(
            r["level"], r["collective"], r["message_bytes"], r["group_size"], r["time_s"]
        )
        for r in m["comm"]
    ]
    old_levels = {lv["name"]: lv for lv in data["topology"]["levels"]}
    levels = [
        LevelPlan(n, old_levels[n]["devices_per_domain"], ())
        for n in dict.fromkeys(c.level for c in comm)
    ]
    cores = (
        int(m["machine"].split(" cores")[0].rsplit(" ", 1)[-1]) if " cores" in m["machine"] else 1
    )
    info = RunInfo(
        name=name,
        kind=data["kind"],
        date=m["date"],
        command=m["command"],
        machine=m["machine"],
        num_cores=cores,
        device_name=data["device"]["name"],
        memory_bytes=data["device"]["memory_bytes"],
        torch_version=m["torch"],
        backend=m["backend"],
        world_size=m["world_size"],
        ranks_per_node=m["ranks_per_node"],
        node_devices=data["node"]["devices"],
        threads_per_rank=m["threads_per_rank"],
        wall_s=m["wall_s"],
    )
    runtime = [
        RuntimeMeasurement(
            r["style"],
            r["num_layers"],
            r["time_s"],
            r.get("optimizer_s", 0.0),
            r.get("batch_size", 1),
        )
        for r in m.get("runtime", [])
    ]
    return render(info, fit_measurements(compute, comm, levels), compute, comm, runtime)


def _ratios(fit: LevelFit, comm: Sequence[LevelMeasurement]) -> str:
    """Per collective, the median of predicted over measured time on this level."""
    by_kind: dict[str, list[float]] = {}
    for m in comm:
        if m.level == fit.level.name:
            predicted = fit.time_s(m.collective, m.message_bytes, m.group_size)
            by_kind.setdefault(m.collective, []).append(predicted / m.time_s)
    return ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in by_kind.items())


def _curve(op: str, fit: CurveFit, source: str) -> list[str]:
    return [
        f"[device.efficiency.{op}]",
        f"max = {_n(fit.curve.max)}",
        f"half_size = {_n(fit.curve.half_size)}",
        f"source = {_s(source)}",
    ]


def _measured(
    info: RunInfo,
    compute: Sequence[ComputeMeasurement],
    comm: Sequence[LevelMeasurement],
    runtime: Sequence[RuntimeMeasurement] = (),
) -> list[str]:
    lines = [
        "",
        "# The raw measurements this profile was fitted to (ignored by the loader).",
        "[measured]",
        f"date = {_s(info.date)}",
        f"command = {_s(info.command)}",
        f"machine = {_s(info.machine)}",
        f"torch = {_s(info.torch_version)}",
        f"backend = {_s(info.backend)}",
        f"world_size = {info.world_size}",
        f"ranks_per_node = {info.ranks_per_node}",
        f"threads_per_rank = {info.threads_per_rank}",
        f"wall_s = {info.wall_s:.1f}",
        "compute = [",
    ]
    lines += [
        f"    {{ op = {_s(m.op)}, dtype = {_s(m.dtype)}, shape = {_s(m.shape)}, "
        f"flops = {_n(m.flops)}, bytes_moved = {_n(m.bytes_moved)}, time_s = {_n(m.time_s)} }},"
        for m in compute
    ]
    lines += ["]", "comm = ["]
    lines += [
        f"    {{ level = {_s(m.level)}, collective = {_s(m.collective)}, "
        f"group_size = {m.group_size}, message_bytes = {_n(m.message_bytes)}, "
        f"time_s = {_n(m.time_s)} }},"
        for m in comm
    ]
    lines += ["]"]
    if runtime:
        lines += ["runtime = ["]
        lines += [
            f"    {{ style = {_s(m.style)}, num_layers = {m.num_layers}, "
            f"batch_size = {m.batch_size}, time_s = {_n(m.time_s)}, "
            f"optimizer_s = {_n(m.optimizer_s)} }},"
            for m in runtime
        ]
        lines += ["]"]
    return lines


def _s(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text, ensure_ascii=False)


def _n(value: float) -> str:
    """A TOML float with 5 significant digits."""
    text = f"{float(value):.5g}"
    return text if any(c in text for c in ".en") else text + ".0"
