"""The README's main job: plan a real model on a shipped cluster, then run a plan on local CPUs.

In: a Hugging Face model preset and a shipped cluster profile. Out: printed text, in two parts.
1. The cluster, the traced model's layer table, the plan `parallelize` finds (summary and
   explanation), saved as JSON (`out/plan.json`).
2. A tiny Llama (the `llama-tiny-hf` preset, a transformers LlamaForCausalLM) planned on the
   `local_cpu` profile with ``local_ranks`` ranks, saved with its generated program
   (`out/local/plan.json`, `out/local/train.py`), and that program run under
   ``torchrun --nproc-per-node=<local_ranks> out/local/train.py --steps <local_steps>`` on gloo:
   its step lines (loss, measured vs predicted step time and memory) are printed.
"""

from __future__ import annotations

import os
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
) -> str:
    """Plan ``model_name`` (an `autopar.models.hf` preset, built on meta) on the cluster, then
    plan, save and run a tiny Llama on ``local_ranks`` CPU ranks (``local_ranks=0`` skips it).

    Raises:
        RuntimeError: the local run failed (its stderr tail is in the message).
    """
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
    if local_ranks:
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
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding autopar/
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={ranks}", str(out / "train.py"), "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the local run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines += [line for line in done.stdout.splitlines() if line.startswith(("step ", "[autopar]"))]
    lines.append(f"planned, saved and ran in {time.perf_counter() - start:.1f} s")
    return lines
