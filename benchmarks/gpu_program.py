"""A generated program's step time and memory on one GPU, against its plan's prediction.

    python3 benchmarks/gpu_program.py prepare DIR    # here (plans need OR-Tools, no GPU)
    python3 benchmarks/gpu_program.py run DIR [--steps 12] [--cases a,b]   # on a GPU machine
    python3 benchmarks/gpu_program.py table DIR      # the table again, from DIR's metrics

The model: a Llama of Llama 3.2 1B's layer shape (16 layers, hidden 2048, FFN 8192, 32 heads,
8 key/value heads, vocabulary 128256; the head untied, so 1.50 B parameters), seq 2048, a
global batch of 16 sequences, on one H100 of the dgx_h100 profile (`num_devices=1`). The
cases, each a plan saved with its train.py:

    pick        what `parallelize` chooses (autopar's stack: eager PyTorch)
    mbs2        micro-batches of 2, no recompute
    full        micro-batches of 8, full recompute
    mbs8        micro-batches of 8, no recompute  \
    mbs8f2      the same, full recompute of 2 of the 16 blocks  > priced near or over the device's
    mbs8f4      the same, full recompute of 4 of the 16 blocks  | memory: whether they run checks
    mbs16full   one micro-batch of 16, full recompute           / that the model refuses no run
    compile     `parallelize` for the autopar-compile stack, run with --compile
    fp8         the pick's config with fp8-tensorwise linears (torchao; carry its wheel)
    fp8compile  the same priced for the autopar-compile stack, run with --compile

`run` launches each case's program under `torchrun --nproc-per-node 1 ... --device cuda` and
reads its metrics file; the table gives per case the predicted and measured step time (the
median of the steps after the first three) and the predicted peak against the measured peaks:
allocated (max_memory_allocated) and reserved (max_memory_reserved, what an OOM is decided on;
the plan's peak includes its allocator reserve, so it stands for this one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # autopar from this checkout, installed or not
GiB = 2**30
SHAPE = dict(
    num_layers=16, hidden=2048, ffn_hidden=8192, num_heads=32, num_kv_heads=8, seq_len=2048
)
# --smoke: the same cases on a small Llama, run on the CPU (checks the script, no figures)
SMOKE_SHAPE = dict(
    SHAPE,
    num_layers=2,
    hidden=64,
    ffn_hidden=128,
    num_heads=4,
    num_kv_heads=2,
    seq_len=32,
    vocab_size=256,
)
BATCH, WARMUP_STEPS = 16, 3
CASES = (
    "pick",
    "mbs2",
    "full",
    "mbs8",
    "mbs8f2",
    "mbs8f4",
    "mbs16full",
    "compile",
    "fp8",
    "fp8compile",
)


def prepare(out: Path, smoke: bool) -> None:
    import autopar
    from autopar.hardware import Cluster
    from autopar.models import zoo

    shape = SMOKE_SHAPE if smoke else SHAPE
    model = zoo.build("llama-8b", device="meta", **shape)
    inputs = zoo.example_inputs("llama-8b", model)
    cluster = Cluster.from_profile("dgx_h100", num_devices=1)
    graph = autopar.trace(model, inputs)
    pick = autopar.parallelize(model, cluster, global_batch_size=BATCH, graph=graph)
    plans = {"pick": pick}

    def priced(config, **kw) -> autopar.Plan:
        return autopar.evaluate(model, cluster, config, global_batch_size=BATCH, graph=graph, **kw)

    plans["mbs2"] = priced(replace(pick.config, micro_batch_size=2, recompute="none"))
    plans["full"] = priced(replace(pick.config, micro_batch_size=8, recompute="full"))
    plans["mbs8"] = priced(replace(pick.config, micro_batch_size=8, recompute="none"))
    for k in (2, 4):
        plans[f"mbs8f{k}"] = priced(
            replace(
                pick.config,
                micro_batch_size=8,
                recompute="full",
                recompute_layers=min(k, shape["num_layers"]),  # --smoke has 2 layers
            )
        )
    plans["mbs16full"] = priced(replace(pick.config, micro_batch_size=16, recompute="full"))
    plans["compile"] = autopar.parallelize(
        model, cluster, global_batch_size=BATCH, graph=graph, stack="autopar-compile"
    )
    plans["fp8"] = priced(pick.config, precision="fp8-tensorwise")
    plans["fp8compile"] = priced(pick.config, precision="fp8-tensorwise", stack="autopar-compile")
    for name, plan in plans.items():
        plan.save(out / name)
        print(
            f"{name:8} {plan.config.as_text()}  predicted {plan.step_time_s:.3f} s, "
            f"peak {plan.peak_memory_bytes / GiB:.1f} GiB of "
            f"{plan.memory_capacity_bytes / GiB:.1f}, {plan.precision}, {plan.stack}"
        )


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run(out: Path, steps: int, cases: list[str], device: str, timeout: float) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    for name in cases:
        case = out / name
        metrics = case / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(case / "train.py"),
            "--device",
            device,
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
        ]
        if name.endswith("compile"):
            cmd.append("--compile")
        if name == "fp8" and device == "cpu":  # torchao's FP8 GEMMs need a GPU
            cmd += ["--precision", "bf16"]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            done = subprocess.CompletedProcess(cmd, -1, _text(exc.stdout), _text(exc.stderr))
        wall = time.perf_counter() - start
        (case / "log.txt").write_text(done.stdout + "\n--- stderr\n" + done.stderr)
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        if done.returncode == -1:
            status = f"timed out after {timeout} s"
        if "OutOfMemoryError" in done.stderr or "CUDA out of memory" in done.stderr:
            status = "out of memory"
        (case / "status.txt").write_text(status)
        print(f"{name}: {status} in {wall:.0f} s", flush=True)
        if done.returncode != 0:
            print(done.stderr[-2500:], flush=True)


def table(out: Path, cases: list[str]) -> list[dict]:
    rows = []
    print(
        f"{'case':8} {'config':44} {'pred s':>7} {'meas s':>7} {'err':>7}  "
        f"{'GiB pred':>8} {'alloc':>6} {'resv':>6}  status"
    )
    for name in cases:
        case = out / name
        status = (case / "status.txt").read_text() if (case / "status.txt").exists() else "-"
        lines = []
        if (case / "metrics.jsonl").exists():
            lines = [json.loads(x) for x in (case / "metrics.jsonl").read_text().splitlines()]
        timed = [x["step_time_s"] for x in lines[WARMUP_STEPS:]]
        measured = statistics.median(timed) if timed else None
        predicted = lines[0]["predicted_step_time_s"] if lines else None
        peak_pred = lines[0]["predicted_peak_memory_bytes"] if lines else None
        alloc = max((x["peak_memory_bytes"] or 0 for x in lines), default=None)
        resv = max((x.get("peak_reserved_bytes") or 0 for x in lines), default=None)
        config = _config_text(case)
        row = dict(
            case=name,
            config=config,
            predicted_s=predicted,
            measured_s=measured,
            status=status,
            spread=(min(timed), max(timed)) if timed else None,
            predicted_peak=peak_pred,
            allocated_peak=alloc,
            reserved_peak=resv,
        )
        rows.append(row)

        def fmt(v, scale=1.0, f="7.3f"):
            return format(v / scale, f) if v else "      -"

        err = f"{measured / predicted - 1:+7.1%}" if measured and predicted else "      -"
        print(
            f"{name:8} {config:44} {fmt(predicted)} {fmt(measured)} {err}  "
            f"{fmt(peak_pred, GiB, '8.1f')} {fmt(alloc, GiB, '6.1f')} {fmt(resv, GiB, '6.1f')}"
            f"  {status}"
        )
    return rows


def _config_text(case: Path) -> str:
    from autopar.plan import Plan

    plan = Plan.from_json((case / "plan.json").read_text())
    config = plan.config
    layers = f":{config.recompute_layers}" if config.recompute_layers else ""
    return (
        f"mbs={config.micro_batch_size} recompute={config.recompute}{layers} {plan.precision} "
        f"{plan.stack}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("prepare", "run", "table"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", help="table: write the rows here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a small Llama on the CPU: checks this script, measures nothing",
    )
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if args.verb == "prepare":
        prepare(args.dir, args.smoke)
        return
    if args.verb == "run":
        run(args.dir, args.steps, cases, "cpu" if args.smoke else "cuda", args.timeout)
    rows = table(args.dir, cases)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
