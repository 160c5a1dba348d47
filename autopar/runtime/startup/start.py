"""A training run's start: the plan's model built on meta, parallelised, then each rank's
shards made on the device -- never the whole model on any rank.

In: the `Task`, the plan's `ParallelConfig` and mesh, the TP plan or placements, the pipeline
spec, the training precision and where the weights come from (`WeightsFrom`: the factory's
initialization, or a Hugging Face checkpoint directory). Out: a `Startup`: the `ParallelModel`
on the device, the low-precision record, the whole model's fingerprint, and a `StartupReport`
(seconds, this rank's peak host and device bytes, elements filled).

    model, record = record_build(task.build_meta, seed)   # meta: no memory, the init recorded
    check_fingerprint(model, plan's)                          # names and shapes, on meta
    model.float()                                             # fp32 master weights (the plan's)
    low precision (FP8 linears), then parallelize_model        # all on meta
    materialize(pm.model, source, device, pm.hand_slices)     # to_empty + each shard filled

Precision: the parameters are fp32 whatever dtype the factory, the config.json
(`torch_dtype: bfloat16`) or a checkpoint stores -- the plan prices fp32 master weights,
bf16 runs as autocast over them and FSDP2 gathers in bf16 (`TrainOptions.precision`).

Equal init under every plan: the values are the factory's own initialization replayed at
each shard's elements with a counter-based generator (`record`, `replay`, `rng`), so one seed
gives the same weights whatever the plan, the rank count or the device count.

Public functions:
    WeightsFrom(checkpoint=None)
    StartupReport, Startup
    start_model(task, config, mesh, ...) -> Startup
    peak_host_bytes() -> float          # this process's peak resident set (VmHWM)
    process_age_s() -> float            # seconds since this process started
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.models.source import check_fingerprint, model_fingerprint
from autopar.runtime.low_precision import LowPrecision, apply_low_precision
from autopar.runtime.mesh import RuntimeMesh
from autopar.runtime.parallelize import ParallelModel, PipelineSpec, parallelize_model
from autopar.runtime.startup.materialize import InitWeights, WeightSource, materialize
from autopar.runtime.startup.record import InitRecord, record_build
from autopar.runtime.tensor_parallel import find_blocks


@dataclass(frozen=True)
class StartupReport:
    """One rank's start, measured: seconds from `start_model`'s call to its shards filled,
    the process's peak resident bytes then (VmHWM: the host), the device's peak allocated
    bytes (None on the CPU), and what was filled from where."""

    seconds: float
    host_peak_bytes: float
    device_peak_bytes: float | None
    num_tensors: int
    num_elements: int
    source: str

    def as_text(self) -> str:
        device = (
            ""
            if self.device_peak_bytes is None
            else (f", device peak {self.device_peak_bytes / 2**20:.1f} MiB")
        )
        return (
            f"startup {self.seconds:.2f} s: {self.num_tensors} tensors, {self.num_elements:,} "
            f"elements from {self.source}; host peak {self.host_peak_bytes / 2**20:.1f} MiB"
            f"{device}"
        )


@dataclass
class Startup:
    model: ParallelModel
    low: LowPrecision | None
    fingerprint: str
    report: StartupReport
    hf_config: Any = None  # a transformers model's config (what a Hugging Face export writes)


def peak_host_bytes() -> float:
    """This process's peak resident set size (Linux: VmHWM, in KiB from getrusage)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where it cannot be read)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WeightsFrom:
    """Where a run's weights come from: None, the factory's initialization (seeded); else a
    Hugging Face checkpoint directory (`hf_checkpoint.HFCheckpoint`)."""

    checkpoint: str | None = None


def start_model(
    task: Any,
    config: ParallelConfig,
    mesh: RuntimeMesh,
    *,
    precision: str = "fp32",
    placements: dict | None = None,
    tp: dict[str, str] | None = None,
    pipeline: PipelineSpec | None = None,
    compile_blocks: bool = False,
    fingerprint: str = "",
    seed: int = 0,
    weights: WeightsFrom | None = None,
) -> Startup:
    """Build, parallelise and materialize the task's model on this rank (module docstring).

    ``pipeline``: pp > 1, the `PipelineSpec` (a traced cut's micro-batch on the meta device,
    as the model is when it is cut).

    Raises:
        ValueError: the model's fingerprint differs from the plan's.
        InitRecordError: the factory made a parameter the record cannot replay.
        CheckpointError: a checkpoint that does not hold the model's tensors.
    """
    t0 = time.perf_counter()
    device = torch.device(mesh.mesh.device_type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, record = record_build(task.build_meta, seed)
    check_fingerprint(model, fingerprint)
    fingerprint = fingerprint or model_fingerprint(model)  # the whole model's, before any cut
    model.float()  # the plan's fp32 master weights, whatever the factory's dtype
    low = apply_low_precision(model, find_blocks(model), precision, config, device)
    # the source reads the whole model's names (a checkpoint's conversions), before any cut
    source, described = _source(weights, model, record, device, seed)
    param_dtype = None if precision == "fp32" else torch.bfloat16
    pm = parallelize_model(
        model, mesh, config, placements, tp, pipeline, compile_blocks, param_dtype
    )
    filled = materialize(pm.model, source, device, pm.hand_slices)
    device_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        device_peak = float(torch.cuda.max_memory_allocated(device))
    report = StartupReport(
        time.perf_counter() - t0,
        peak_host_bytes(),
        device_peak,
        filled.num_tensors,
        filled.num_elements,
        described,
    )
    config_of = getattr(model, "config", None)
    hf_config = config_of if hasattr(config_of, "save_pretrained") else None
    return Startup(pm, low, fingerprint, report, hf_config)


def build_whole(
    task: Any,
    seed: int = 0,
    device: torch.device | str = "cpu",
    weights: WeightsFrom | None = None,
) -> nn.Module:
    """The task's whole model in one process, made as `start_model` makes every shard: the
    single-process reference the sharded runs are compared with (`trainer.reference_run`),
    and the model a conversion reads whole."""
    model, record = record_build(task.build_meta, seed)
    model.float()
    source, _ = _source(weights, model, record, torch.device(device), seed)
    materialize(model, source, device)
    return model


def _source(
    weights: WeightsFrom | None,
    model: nn.Module,
    record: InitRecord,
    device: torch.device,
    seed: int,
) -> tuple[WeightSource, str]:
    """Where the weights come from, and those words for the report."""
    if weights is not None and weights.checkpoint is not None:
        from autopar.runtime.startup.hf_checkpoint import HFCheckpoint

        source = HFCheckpoint(weights.checkpoint, model, record, device)
        return source, f"checkpoint {weights.checkpoint}"
    return InitWeights(record, device), f"the factory's init (seed {seed})"
