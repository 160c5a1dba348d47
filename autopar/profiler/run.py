"""The profiler's driver: launch under torchrun, measure on every rank, write on rank 0.

`profile` is what ``autopar profile`` calls. Outside torchrun it starts
``python -m torch.distributed.run --standalone --nproc-per-node N -m autopar profile ...`` and
waits; under torchrun (which sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and GROUP_RANK) each rank
runs `measure_and_write`: the compute measurements on every rank at once, then the
collectives, then the runtime overheads (an even number of ranks), then rank 0 fits and
writes the profile. The file is written to a temporary name,
loaded back with `autopar.hardware.load_profile`, and only then moved to ``out``, so a failed
run leaves no half-written profile behind.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, ProfileError
from autopar.hardware.profile import load_profile
from autopar.profiler.comm import CommPlan, discover_levels, measure_comm
from autopar.profiler.compute import ComputeMeasurement, ComputePlan, measure_compute
from autopar.profiler.document import RunInfo, capped_curves, fit_measurements, render
from autopar.profiler.runtime_overhead import measure_runtime

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True)
class ProfileOptions:
    """What `profile` measures and writes.

    Attributes:
        out: the profile file to write; its stem becomes the profile's ``name``.
        num_procs: ranks per node that the launcher starts (outside torchrun).
        quick: a few sizes and short timings (tests); the full run takes minutes.
        node_devices: ``node.devices`` to write (ranks a plan may use per node); None: the
            ranks per node measured. On a CPU it also divides the RAM into ``memory_bytes``.
    """

    out: Path
    num_procs: int = 2
    quick: bool = False
    node_devices: int | None = None

    def __post_init__(self) -> None:
        if Path(self.out).suffix != ".toml":
            raise ProfileError(f"--out must name a .toml file, got {str(self.out)!r}")
        if self.num_procs < 1:
            raise ProfileError(f"--nproc must be >= 1, got {self.num_procs}")
        if self.node_devices is not None and self.node_devices < 1:
            raise ProfileError(f"--node-devices must be >= 1, got {self.node_devices}")

    def cli_args(self) -> list[str]:
        """The verb's arguments for the ranks (no --nproc: torchrun's parser would take it)."""
        args = ["profile", "--out", str(self.out)]
        if self.quick:
            args.append("--quick")
        if self.node_devices is not None:
            args += ["--node-devices", str(self.node_devices)]
        return args


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def profile(options: ProfileOptions) -> str:
    """Measure this machine and write ``options.out``; returns the profile's summary (rank 0).

    Raises:
        AutoparError: torchrun failed (its ranks' errors are on stderr), or the written
            profile does not load.
    """
    if under_torchrun():
        return measure_and_write(options)
    if options.num_procs < 2:
        raise ProfileError("--nproc must be >= 2: the collectives need two ranks")
    # The package's parent on the path, so that `-m autopar` finds this very checkout.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={options.num_procs}",
        "-m",
        "autopar",
        *options.cli_args(),
    ]
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0:
        raise AutoparError(f"profile: torchrun exited with code {done.returncode}: {command}")
    return ""  # rank 0 printed the summary


def measure_and_write(options: ProfileOptions) -> str:
    """One rank's part of a profile run under torchrun; rank 0 writes and returns the summary."""
    started = time.perf_counter()
    gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        rank = dist.get_rank()

        def progress(message: str) -> None:
            if rank == 0:
                print(f"[profile {time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr)

        progress(f"{dist.get_world_size()} ranks, {dist.get_backend()}; compute")
        mine = measure_compute(
            device, ComputePlan.for_device(device, quick=options.quick), progress
        )
        compute = _median_over_ranks(mine)
        levels = discover_levels("loopback" if not gpu else "intra_node")
        progress(
            "communication: " + ", ".join(f"{lv.name} {len(lv.members)} ranks" for lv in levels)
        )
        comm = measure_comm(levels, CommPlan.default(quick=options.quick), device, progress)
        runtime = []
        if dist.get_world_size() % 2 == 0:
            progress("runtime overheads: a small Llama through autopar.runtime, by style")
            runtime = measure_runtime(dist.get_world_size(), quick=options.quick, progress=progress)
        if rank != 0:
            return ""
        fits = fit_measurements(compute, comm, levels)
        info = _run_info(options, device, time.perf_counter() - started)
        text = render(info, fits, compute, comm, runtime)
        summary = _write(Path(options.out), text)
        progress(f"wrote {options.out}")
        capped = capped_curves(text)
        if capped:
            progress(
                f"warning: the training factor would lift the {', '.join(capped)} curve(s) over "
                "1 and was capped there: a micro-batch of 4 grew far less than its ops, as when "
                "other work slows the timings (check `uptime`); profile again at low load"
            )
        return summary
    finally:
        dist.destroy_process_group()


def _median_over_ranks(mine: list[ComputeMeasurement]) -> list[ComputeMeasurement]:
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [
        ComputeMeasurement(
            m.op,
            m.dtype,
            m.shape,
            m.flops,
            m.bytes_moved,
            statistics.median(r[i].time_s for r in everyone),
        )  # type: ignore[index]
        for i, m in enumerate(mine)
    ]


def _write(out: Path, text: str) -> str:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not *.toml: a profile directory's listing must not show a half-checked file.
    tmp = out.with_name(f".{out.stem}.toml.partial")
    tmp.write_text(text)
    try:
        loaded = load_profile(tmp)
    except ProfileError as e:
        tmp.unlink()
        raise ProfileError(f"the measured profile does not load: {e}") from None
    os.replace(tmp, out)
    return loaded.as_text()


def _run_info(options: ProfileOptions, device: torch.device, wall_s: float) -> RunInfo:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    node_devices = options.node_devices or per_node
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = cpu_model()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        machine = f"{props.name} x {per_node}, host {cpu} ({cores} cores)"
        device_name, memory = props.name, float(props.total_memory)
    else:
        machine = f"{cpu}, {cores} cores, {ram / 2**30:.1f} GiB RAM"
        threads = torch.get_num_threads()
        device_name = f"{cpu} rank ({threads} thread{'s' if threads > 1 else ''})"
        memory = float(ram // node_devices)
    return RunInfo(
        name=Path(options.out).stem,
        kind="gpu" if device.type == "cuda" else "cpu",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=_command(options, per_node),
        machine=machine,
        num_cores=cores,
        device_name=device_name,
        memory_bytes=memory,
        torch_version=torch.__version__,
        backend=dist.get_backend(),
        world_size=dist.get_world_size(),
        ranks_per_node=per_node,
        node_devices=node_devices,
        threads_per_rank=torch.get_num_threads(),
        wall_s=wall_s,
    )


def _command(options: ProfileOptions, num_procs: int) -> str:
    args = options.cli_args()
    args[2] = Path(options.out).name  # the file, not where this run happened to write it
    return "autopar " + " ".join([*args[:3], "--nproc", str(num_procs), *args[3:]])


def cpu_model() -> str:
    """This machine's CPU model name (/proc/cpuinfo's, else the platform's): what a CPU
    profile's device name starts with."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
