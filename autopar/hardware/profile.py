"""Hardware profiles: TOML files in ``hardware_profiles/`` -> `HardwareProfile`.

In: a shipped profile's name (``"dgx_h100"``) or a path to a TOML file in the format of
``hardware_profiles/README.md``. Out: a frozen `HardwareProfile` holding the cost model's own
types (`cost_models.compute.DeviceSpec`, `cost_models.comm.Level` / `Torus`).
Invariant: every number is validated on load; an error names the file, the field path and the
value, so a profile that loads is one the cost model can price with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import tomllib

from autopar.errors import ProfileError
from cost_models.comm import COLLECTIVES, Level, Torus
from cost_models.compute import DTYPES, DeviceSpec, EfficiencyCurve

SCHEMA_VERSION = 1
# [runtime] layer_overhead_s keys: plain tensors, TP, TP with sequence parallelism, FSDP2
# with ZeRO-1/2 and with ZeRO-3, selective and full recompute of plain layers, and plain
# tensors with the backward split into input and weight passes as the zero-bubble schedules
# run it (autopar.estimate.layer_cost.runtime_overhead_s and split_backward_overhead_s combine
# them); every style is optional in a profile
RUNTIME_STYLES = ("plain", "tp", "tp_sp", "fsdp", "fsdp3", "selective", "full", "split")
Kind = Literal["gpu", "tpu", "cpu"]


# An estimate, for profiles that do not measure it: two RPCs a step over the data-centre
# network (each well under a millisecond) and the wait for the slowest group to ask for the
# quorum. local_cpu measures 2.2 ms (`benchmarks/ft_goodput.py`: two groups on one machine).
FT_CONTROL_S = 0.005

# The spread of sustained speed between devices of one model (relative standard deviation), for
# GPU profiles that do not state their own: boost clocks under power and thermal management
# differ from chip to chip, and a synchronous step runs at its slowest device's pace (the
# cost of that: `autopar.hardware.cluster.Cluster.straggler_share`). Sinha et al., "Not All
# GPUs Are Created Equal" (SC22, arXiv 2208.11035), measured 8% between the fastest and
# slowest of thousands of same-SKU GPUs in GEMM-bound runs, some 1% as a standard deviation on
# a cluster that size; 0.5% is the one value fitted over the 67 BF16 rows of
# data/published_grids.csv, whose weak-scaling grids run 1.7-3.0% slower from their smallest
# to their largest device count at the same work per device (benchmarks/published_grids.py:
# median |error| 5.9% -> 4.8%). TPUs run their chips in lockstep at a fixed clock (0), and a
# CPU profile is measured on the ranks it prices (0).
GPU_SPEED_SPREAD = 0.005


@dataclass(frozen=True)
class Reliability:
    """How devices fail and how fast checkpoints move (the profile's [reliability] table).

    failure_rate_per_device_hour: unexpected job interruptions per device per hour (the
        job's mean time between failures is 1 / (devices x rate)).
    restart_s: relaunching the job after a failure: scheduling, process start, rendezvous
        and communicator setup (loading the checkpoint is priced from the bandwidth below).
    storage_bytes_per_s_per_device: checkpoint write (and read) bandwidth per device (the
        storage system's aggregate over the devices it serves).
    host_copy_bytes_per_s: device-to-host copy per device (an asynchronous checkpoint's stall).
    checkpoint_overhead_s: fixed cost of one checkpoint (planning, metadata, file creation).
    ft_control_s: torchft's own control work a step with fault-tolerant replica groups: the
        quorum (an RPC to the lighthouse, answered when every live group has asked, so it
        also waits out the groups' step-to-step jitter) and the commit (an RPC through the
        group's manager). Optional in a profile; `FT_CONTROL_S` where it is not measured.
    rejoin_s: a restarted fault-tolerant replica group's return beyond its restart: its
        torchft manager's first quorum with the live groups and the heal's transport set up
        around the state it copies (the copy itself is priced from the link's bandwidth).
        Optional in a profile; 0 where it is not measured (an estimated `restart_s` counts
        rendezvous and communicator setup already).
    """

    failure_rate_per_device_hour: float
    restart_s: float
    storage_bytes_per_s_per_device: float
    host_copy_bytes_per_s: float
    checkpoint_overhead_s: float = 0.0
    ft_control_s: float = FT_CONTROL_S
    rejoin_s: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    kind: Kind
    spec_device: str
    device: DeviceSpec
    devices_per_node: int
    levels: tuple[Level, ...]  # empty for a torus profile
    torus: Torus | None
    sources: Mapping[str, str]  # table path -> the source its numbers cite
    path: str
    # devices of a node that compute at once at the device's rates (CPU cores the ranks run
    # on); 0: all of them. `Cluster` time-shares the device when more devices are used.
    compute_slots: int = 0
    # Host time the training runtime spends per repeated layer per micro-batch (forward and
    # backward together) beyond what the op-level model prices, by parallel style
    # (RUNTIME_STYLES); measured by `autopar profile`, empty for datasheet profiles.
    runtime_overhead_s: Mapping[str, float] = field(default_factory=dict)
    # The same for the optimizer step (clipping, AdamW) per repeated layer per step.
    optimizer_overhead_s: Mapping[str, float] = field(default_factory=dict)
    # The same per micro-batch for everything outside the repeated layers (embedding, head,
    # loss and their backward), by style; empty where not measured.
    model_overhead_s: Mapping[str, float] = field(default_factory=dict)
    # The software stack the efficiency curves describe (`autopar.estimate.stacks`): a GPU or
    # TPU profile's curves were fitted to published Megatron-LM and MosaicML runs
    # ("megatron-lm"), a profile `autopar profile` measured describes autopar's own runtime
    # ("autopar"). Pricing another stack scales the curves by the two stacks' kernel ratios.
    efficiency_stack: str = "megatron-lm"
    # device failures and checkpoint bandwidth ([reliability]); None where the profile has none
    reliability: Reliability | None = None
    # relative standard deviation of the devices' sustained speed ([device] speed_spread;
    # `GPU_SPEED_SPREAD` for a GPU profile that does not state it, else 0)
    speed_spread: float = 0.0

    def as_text(self) -> str:
        d = self.device
        peaks = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in d.peak_flops_per_s.items())
        lines = [
            f"{self.name}: {self.description}",
            f"  device  {d.name}: {d.memory_bytes / 2**30:.1f} GiB at "
            f"{d.memory_bandwidth_bytes_per_s / 1e12:.2f} TB/s; {peaks}",
            f"  node    {self.devices_per_node} devices"
            + (f", computing {self.compute_slots} at a time" if self.compute_slots else ""),
        ]
        for lv in self.levels:
            domain = "cluster" if lv.devices_per_domain == 0 else f"{lv.devices_per_domain} dev"
            inr = (
                f", in-network reduction x{lv.in_network_reduction_efficiency}"
                if lv.in_network_reduction_efficiency
                else ""
            )
            lines.append(
                f"  level   {lv.name:<12} domain {domain:<8} "
                f"{lv.bandwidth_bytes_per_s / 1e9:7.1f} GB/s/dir, {lv.latency_s * 1e6:.1f} us, "
                f"eff {lv.efficiency}{inr}"
            )
        if self.torus is not None:
            t = self.torus
            lines.append(
                f"  torus   {t.num_dims}D up to {'x'.join(map(str, t.max_shape))}, "
                f"{t.link_bandwidth_bytes_per_s / 1e9:.1f} GB/s per link per direction, "
                f"wraparound from size {t.wraparound_min_size}"
            )
        return "\n".join(lines)


def shipped_profile_names() -> list[str]:
    """Names of the profiles that ship with autopar, sorted."""
    root = resources.files("hardware_profiles")
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name, or any profile TOML by path.

    Raises:
        ProfileError: unknown name (the message lists the shipped ones), unreadable or
            malformed file, a missing, negative or out-of-range field.
    """
    text, origin = _read(name_or_path)
    return profile_from_text(text, origin)


def profile_from_text(text: str, origin: str = "<profile text>") -> HardwareProfile:
    """A profile from its TOML text; ``origin`` names it in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{origin}: not valid TOML: {e}") from None
    return _parse(_Fields(origin, data), origin)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a TOML text file (its bytes are not UTF-8 text)") from None
    except OSError as e:
        raise ProfileError(f"{path}: cannot read it: {e.strerror}") from None


def _read(name_or_path: str | Path) -> tuple[str, str]:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.parent != Path("."):
        if not path.is_file():
            raise ProfileError(f"{path}: no such hardware profile file")
        return _text(path), str(path)
    resource = resources.files("hardware_profiles") / f"{name_or_path}.toml"
    if not resource.is_file():
        shipped = ", ".join(shipped_profile_names())
        raise ProfileError(
            f"unknown hardware profile {str(name_or_path)!r}; shipped profiles: {shipped} "
            "(or give a path to a .toml file)"
        )
    return resource.read_text(), str(resource)


class _Fields:
    """Typed access to a parsed TOML document; errors carry the file and the field path."""

    def __init__(self, origin: str, data: dict[str, Any]) -> None:
        self.origin = origin
        self.data = data

    def error(self, path: str, problem: str) -> ProfileError:
        return ProfileError(f"{self.origin}: field {path}: {problem}")

    def get(self, path: str, *, required: bool = True) -> Any:
        node: Any = self.data
        for part in path.replace("]", "").replace("[", ".").split("."):
            key: Any = int(part) if part.isdigit() else part
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                if required:
                    raise self.error(path, "missing") from None
                return None
        return node

    def number(self, path: str, *, minimum: float = 0.0, strict: bool = True) -> float:
        value = self.get(path)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):  # TOML spells inf and nan; no cost is priced with them
            raise self.error(path, f"must be a finite number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            raise self.error(path, f"must be {bound}, got {value!r}")
        return float(value)

    def optional_number(self, path: str, default: float, *, strict: bool = True) -> float:
        """`number` where the profile states ``path``, else ``default``."""
        if self.get(path, required=False) is None:
            return default
        return self.number(path, strict=strict)

    def integer(self, path: str, *, minimum: int = 1) -> int:
        value = self.get(path)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(path, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def string(self, path: str) -> str:
        value = self.get(path)
        if not isinstance(value, str):
            raise self.error(path, f"must be a string, got {value!r}")
        return value

    def fraction(self, path: str) -> float:
        value = self.number(path)
        if value > 1:
            raise self.error(path, f"must be in (0, 1], got {value!r}")
        return value


def _parse(f: _Fields, origin: str) -> HardwareProfile:
    version = f.integer("schema_version")
    if version != SCHEMA_VERSION:
        raise f.error(
            "schema_version", f"this autopar reads version {SCHEMA_VERSION}, got {version}"
        )
    kind = f.string("kind")
    if kind not in ("gpu", "tpu", "cpu"):
        raise f.error("kind", f"must be one of gpu, tpu, cpu, got {kind!r}")
    sources = {
        table: f.string(f"{table}.source")
        for table in ("device", "device.peak_flops_per_s", "node")
        + tuple(f"device.efficiency.{c}" for c in ("matmul", "attention", "memory"))
    }
    if f.get("device.efficiency.matmul_fp32", required=False) is not None:
        sources["device.efficiency.matmul_fp32"] = f.string("device.efficiency.matmul_fp32.source")
    levels = _parse_levels(f, sources)
    torus = _parse_torus(f, sources)
    if (torus is None) == (not levels):
        raise f.error("topology", "give either [[topology.levels]] or [topology.torus], not both")
    return HardwareProfile(
        name=f.string("name"),
        description=f.string("description"),
        kind=kind,  # type: ignore[arg-type]
        spec_device=f.string("spec_device"),
        device=_parse_device(f),
        devices_per_node=f.integer("node.devices"),
        levels=levels,
        torus=torus,
        sources=sources,
        path=origin,
        compute_slots=_compute_slots(f),
        runtime_overhead_s=_runtime_overheads(f, sources, "layer_overhead_s"),
        optimizer_overhead_s=_runtime_overheads(f, sources, "optimizer_overhead_s"),
        model_overhead_s=_runtime_overheads(f, sources, "model_overhead_s"),
        efficiency_stack=_efficiency_stack(f, kind),
        reliability=_reliability(f, sources),
        speed_spread=_speed_spread(f, kind),
    )


def _speed_spread(f: _Fields, kind: str) -> float:
    if f.get("device.speed_spread", required=False) is None:
        return GPU_SPEED_SPREAD if kind == "gpu" else 0.0
    value = f.number("device.speed_spread", strict=False)
    if value >= 1:
        raise f.error("device.speed_spread", f"must be in [0, 1), got {value!r}")
    return value


def _reliability(f: _Fields, sources: dict[str, str]) -> Reliability | None:
    if f.get("reliability", required=False) is None:
        return None
    sources["reliability"] = f.string("reliability.source")
    return Reliability(
        failure_rate_per_device_hour=f.number("reliability.failure_rate_per_device_hour"),
        restart_s=f.number("reliability.restart_s", strict=False),
        storage_bytes_per_s_per_device=f.number("reliability.storage_bytes_per_s_per_device"),
        host_copy_bytes_per_s=f.number("reliability.host_copy_bytes_per_s"),
        checkpoint_overhead_s=f.number("reliability.checkpoint_overhead_s", strict=False),
        ft_control_s=f.optional_number("reliability.ft_control_s", FT_CONTROL_S),
        rejoin_s=f.optional_number("reliability.rejoin_s", 0.0, strict=False),
    )


def _efficiency_stack(f: _Fields, kind: str) -> str:
    """``device.efficiency.stack``, or by kind: "autopar" for a CPU profile (measured through
    autopar's runtime by `autopar profile`), "megatron-lm" for the fitted GPU/TPU ones."""
    if f.get("device.efficiency.stack", required=False) is None:
        return "autopar" if kind == "cpu" else "megatron-lm"
    return f.string("device.efficiency.stack")


def _runtime_overheads(f: _Fields, sources: dict[str, str], key: str) -> dict[str, float]:
    """[runtime] ``key``: seconds by style (layer_overhead_s required, the optimizer's not)."""
    if f.get("runtime", required=False) is None:
        return {}
    sources["runtime"] = f.string("runtime.source")
    path = f"runtime.{key}"
    table = f.get(path, required=key == "layer_overhead_s")
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise f.error(path, f"must be a table, got {table!r}")
    unknown = sorted(set(table) - set(RUNTIME_STYLES))
    if unknown:
        raise f.error(
            path, f"unknown style(s) {', '.join(unknown)}; known: {', '.join(RUNTIME_STYLES)}"
        )
    return {k: f.number(f"{path}.{k}", strict=False) for k in RUNTIME_STYLES if k in table}


def _compute_slots(f: _Fields) -> int:
    if f.get("node.compute_slots", required=False) is None:
        return 0
    slots = f.integer("node.compute_slots")
    devices = f.integer("node.devices")
    if slots > devices:
        raise f.error("node.compute_slots", f"must be <= node.devices = {devices}, got {slots}")
    return slots


def _parse_device(f: _Fields) -> DeviceSpec:
    peaks = f.get("device.peak_flops_per_s")
    if not isinstance(peaks, dict):
        raise f.error("device.peak_flops_per_s", "must be a table of dtype = FLOP/s")
    flops = {}
    for dtype in peaks:
        if dtype == "source":
            continue
        if dtype not in DTYPES:
            raise f.error(
                f"device.peak_flops_per_s.{dtype}",
                f"unknown dtype {dtype!r}; known dtypes: {', '.join(DTYPES)}",
            )
        flops[dtype] = f.number(f"device.peak_flops_per_s.{dtype}")
    if "fp32" not in flops:
        raise f.error("device.peak_flops_per_s.fp32", "missing (elementwise ops are priced on it)")

    def curve(op: str) -> EfficiencyCurve:
        base = f"device.efficiency.{op}"
        half = f.number(f"{base}.half_size", strict=False)
        return EfficiencyCurve(f.fraction(f"{base}.max"), half)

    fp32 = None  # optional: fp32 GEMMs on the vector units (`DeviceSpec.matmul_fp32`)
    if f.get("device.efficiency.matmul_fp32", required=False) is not None:
        fp32 = curve("matmul_fp32")
    return DeviceSpec(
        name=f.string("device.name"),
        memory_bytes=f.number("device.memory_bytes"),
        memory_bandwidth_bytes_per_s=f.number("device.memory_bandwidth_bytes_per_s"),
        launch_overhead_s=f.number("device.launch_overhead_s", strict=False),
        peak_flops_per_s=flops,
        matmul=curve("matmul"),
        attention=curve("attention"),
        memory=curve("memory"),
        matmul_fp32=fp32,
    )


def _parse_levels(f: _Fields, sources: dict[str, str]) -> tuple[Level, ...]:
    raw = f.get("topology.levels", required=False)
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise f.error("topology.levels", "must be a non-empty array of tables")
    levels = []
    for i in range(len(raw)):
        p = f"topology.levels[{i}]"
        inr = None
        if f.get(f"{p}.in_network_reduction", required=False) is not None:
            inr = f.fraction(f"{p}.in_network_reduction.efficiency")
            sources[f"{p}.in_network_reduction"] = f.string(f"{p}.in_network_reduction.source")
        domain = f.integer(f"{p}.devices_per_domain", minimum=0)
        levels.append(
            Level(
                name=f.string(f"{p}.name"),
                devices_per_domain=domain,
                bandwidth_bytes_per_s=f.number(f"{p}.bandwidth_bytes_per_s"),
                latency_s=f.number(f"{p}.latency_s", strict=False),
                efficiency=f.fraction(f"{p}.efficiency"),
                in_network_reduction_efficiency=inr,
                collective_latency_s=_collective_latencies(f, f"{p}.collective_latency_s"),
            )
        )
        sources[p] = f.string(f"{p}.source")
    _check_level_nesting(f, levels)
    return tuple(levels)


def _collective_latencies(f: _Fields, path: str) -> tuple[tuple[str, float], ...]:
    table = f.get(path, required=False)
    if table is None:
        return ()
    if not isinstance(table, dict):
        raise f.error(path, "must be a table of collective = seconds")
    for name in table:
        if name not in COLLECTIVES:
            raise f.error(f"{path}.{name}", f"unknown collective; known: {', '.join(COLLECTIVES)}")
    return tuple((name, f.number(f"{path}.{name}", strict=False)) for name in sorted(table))


def _check_level_nesting(f: _Fields, levels: list[Level]) -> None:
    sizes = [lv.devices_per_domain for lv in levels]
    if sizes[-1] != 0:
        raise f.error(
            f"topology.levels[{len(levels) - 1}].devices_per_domain",
            f"the outermost level must span the whole cluster (0), got {sizes[-1]}",
        )
    inner = 1
    for i, size in enumerate(sizes[:-1]):
        if size < 1 or size % inner:
            raise f.error(
                f"topology.levels[{i}].devices_per_domain",
                f"must be a positive multiple of the level inside it ({inner}), got {size}",
            )
        inner = size


def _parse_torus(f: _Fields, sources: dict[str, str]) -> Torus | None:
    if f.get("topology.torus", required=False) is None:
        return None
    p = "topology.torus"
    num_dims = f.integer(f"{p}.num_dims")
    shape = f.get(f"{p}.max_shape")
    if (
        not isinstance(shape, list)
        or len(shape) != num_dims
        or not all(isinstance(d, int) and d >= 1 for d in shape)
    ):
        raise f.error(f"{p}.max_shape", f"must be {num_dims} positive integers, got {shape!r}")
    sources[p] = f.string(f"{p}.source")
    return Torus(
        num_dims=num_dims,
        max_shape=tuple(shape),
        link_bandwidth_bytes_per_s=f.number(f"{p}.link_bandwidth_bytes_per_s"),
        latency_s=f.number(f"{p}.latency_s", strict=False),
        efficiency=f.fraction(f"{p}.efficiency"),
        wraparound_min_size=f.integer(f"{p}.wraparound_min_size"),
    )
