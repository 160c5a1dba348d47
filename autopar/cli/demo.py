"""The README's main job: plan a real model on a shipped cluster, then run a plan on local CPUs.

In: a Hugging Face model preset and a shipped cluster profile. Out: printed text, in two parts.
1. The cluster, the traced model's layer table, the plan `parallelize` finds (summary and
   explanation), saved as JSON (`out/plan.json`).
2. A tiny Llama (the `llama-tiny-hf` preset, a transformers LlamaForCausalLM) planned on the
   `local_cpu` profile with ``local_ranks`` ranks, saved with its generated program
   (`out/local/plan.json`, `out/local/train.py`), and that program run under
   ``torchrun --nproc-per-node=<local_ranks> out/local/train.py --steps <local_steps>`` on gloo:
   its step lines (loss, measured vs predicted step time and memory) are printed.
   With ``local_groups`` = M > 1 the local plan is HSDP with M data-parallel replicas, run as M
   fault-tolerant replica groups over torchft: the demo starts torchft's lighthouse (in this
   process, waiting for all M groups so that they step together), then one torchrun per group
   (``train.py --ft-group g --ft-groups M --lighthouse URL``), and prints each group's step
   lines, torchft's cost a step and each rank's parameter digest, which must agree across the
   groups (`autopar.runtime.fault_tolerance`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

LOCAL_MODEL = "llama-tiny-hf"


def run_demo(
    model_name: str = "llama3-8b",
    profile: str = "dgx_h100",
    num_nodes: int = 2,
    seq_len: int = 8192,
    out_dir: str | None = None,
    local_ranks: int = 4,
    local_steps: int = 10,
    local_groups: int = 1,
) -> str:
    """Plan ``model_name`` (an `autopar.models.hf` preset, built on meta) on the cluster, then
    plan, save and run a tiny Llama on ``local_ranks`` CPU ranks (``local_ranks=0`` skips it),
    as ``local_groups`` fault-tolerant replica groups where that is more than 1.

    Raises:
        RuntimeError: the local run failed (its stderr tail is in the message).
        ValueError: ``local_groups`` does not divide ``local_ranks``.
    """
    if local_groups < 1 or local_ranks % local_groups:
        raise ValueError(
            f"--local-groups {local_groups} must divide --local-ranks {local_ranks} (each "
            "group is an equal share of the ranks)"
        )
    from autopar.api import parallelize, trace
    from autopar.hardware import Cluster
    from autopar.models import hf

    cluster = Cluster.from_profile(profile, num_nodes=num_nodes)
    lines = [cluster.as_text(), ""]
    start = time.perf_counter()
    model = hf.build(model_name)
    inputs = hf.example_inputs(model_name, model, seq_len=seq_len)
    graph = trace(model, inputs)
    lines += [graph.as_text(), ""]
    plan = parallelize(model, cluster, graph=graph)
    lines += [plan.summary(), "", plan.explain(), ""]
    out = Path(out_dir if out_dir is not None else "out")
    lines.append(f"plan written to {plan.save(out)}")
    lines.append(f"traced and planned in {time.perf_counter() - start:.1f} s")
    if local_ranks and local_groups > 1:
        lines += ["", *_local_groups(out / "local", local_ranks, local_steps, local_groups)]
    elif local_ranks:
        lines += ["", *_local_run(out / "local", local_ranks, local_steps)]
    return "\n".join(lines)


def _local_run(out: Path, ranks: int, steps: int) -> list[str]:
    """Plan the tiny Llama on local CPUs, save it, run its program under torchrun."""
    from autopar.api import parallelize
    from autopar.hardware import Cluster
    from autopar.models import hf

    start = time.perf_counter()
    model = hf.build(LOCAL_MODEL)
    cluster = Cluster.from_profile("local_cpu", 1, num_devices=ranks)
    plan = parallelize(model, cluster, global_batch_size=2 * ranks, precision="fp32")
    plan.save(out)
    lines = [
        f"== {LOCAL_MODEL} on local_cpu x {ranks} ranks: {plan.config.as_text()}",
        f"predicted step {plan.step_time_s * 1e3:.1f} ms, peak "
        f"{plan.peak_memory_bytes / 2**20:.1f} MiB per rank; program {out / 'train.py'}",
        f"$ torchrun --nproc-per-node={ranks} {out / 'train.py'} --steps {steps}",
    ]
    cmd = [*_torchrun(ranks), str(out / "train.py"), "--steps", str(steps)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the local run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines += _printed(done.stdout)
    lines.append(f"planned, saved and ran in {time.perf_counter() - start:.1f} s")
    return lines


def _local_groups(out: Path, ranks: int, steps: int, groups: int) -> list[str]:
    """The tiny Llama as HSDP over ``groups`` data-parallel replicas, run as that many
    fault-tolerant replica groups through torchft's lighthouse (module docstring)."""
    from torchft._torchft import LighthouseServer  # torchft: installed with autopar

    from autopar.api import evaluate
    from autopar.config import ParallelConfig
    from autopar.hardware import Cluster
    from autopar.models import hf

    start = time.perf_counter()
    model = hf.build(LOCAL_MODEL)
    cluster = Cluster.from_profile("local_cpu", 1, num_devices=ranks)
    per_group = ranks // groups
    config = ParallelConfig(dp=groups, fsdp=per_group, zero_stage=3 if per_group > 1 else 0)
    inputs = hf.example_inputs(LOCAL_MODEL, model)
    plan = evaluate(model, cluster, config, inputs, global_batch_size=2 * ranks, precision="fp32")
    plan.save(out)
    # the lighthouse waits for every group: they step together, and end equal
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=groups, join_timeout_ms=10000, quorum_tick_ms=100
    )
    url = lighthouse.address()
    lines = [
        f"== {LOCAL_MODEL} on local_cpu x {ranks} ranks as {groups} fault-tolerant replica "
        f"groups of {per_group}: {plan.config.as_text()}",
        f"torchft's lighthouse at {url}; each group:",
        f"$ torchrun --nproc-per-node={per_group} {out / 'train.py'} --steps {steps} "
        f"--ft-group G --ft-groups {groups} --lighthouse {url}",
    ]
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "RUST_LOG": "error"}
    jobs = []
    try:
        for g in range(groups):
            flags = ["--ft-group", str(g), "--ft-groups", str(groups), "--lighthouse", url]
            cmd = [*_torchrun(per_group), str(out / "train.py"), "--steps", str(steps), *flags]
            jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))  # fmt: skip
        done = [job.communicate(timeout=600) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
        lighthouse.shutdown()
    for g, (job, (stdout, stderr)) in enumerate(zip(jobs, done, strict=True)):
        if job.returncode != 0:
            raise RuntimeError(f"replica group {g} failed ({job.returncode}):\n{stderr[-3000:]}")
        lines += [f"[group {g}] {line}" for line in _printed(stdout)]
    digests = re.findall(r"replica group \d+, rank (\d+): parameters (\w+)", "\n".join(lines))
    agree = all(len({d for r, d in digests if r == rank}) == 1 for rank, _ in digests)
    lines.append(
        "each rank's parameters are "
        + ("the same in every group" if agree else "NOT the same in every group")
    )
    lines.append(f"planned, saved and ran in {time.perf_counter() - start:.1f} s")
    return lines


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}"]  # fmt: skip


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding autopar/
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
    }


def _printed(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("step ", "[autopar]"))]
