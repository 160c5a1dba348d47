"""Startup of a generated program: time to first step and each rank's peak memory (issue 44).

    python3 benchmarks/startup.py --precision bf16 --release-host-memory  # ~1B, FSDP8, 8 ranks
    python3 benchmarks/startup.py --size small --nproc 4 --config "fsdp=4 | zero=3"  # quick
    python3 benchmarks/startup.py --config "tp=2 pp=2 | mbs=1" --nproc 4 --size small
    python3 benchmarks/startup.py --steps 0      # the 1B model's startup alone
    python3 benchmarks/startup.py --imports 7    # a rank's imports alone, CPU s (7 runs)

In: a Llama-shaped zoo model (`llama-tiny` with the overrides of ``--size``: "1b" is hidden
2048, 16 blocks, FFN 5632, GQA 16/8 heads, vocabulary 32000, 0.89 B parameters, 3.3 GiB of
fp32 weights; "0.5b" hidden 1536, 16 blocks, FFN 4096, 0.50 B; "small" 0.10 B), a plan of
``--config`` priced on ``local_cpu`` x ``--nproc`` in ``--precision``
(`autopar.evaluate`), written with `plan.save`, and its train.py run under
`torchrun --standalone` for ``--steps`` steps (sequence ``--seq``, global batch ``--batch``;
``--release-host-memory`` passed on: `autopar.runtime.host_memory`).

Out: per rank, as the program prints them (`autopar.runtime.run_report`): the startup's
seconds (build on meta, parallelise, make the rank's shards), the rank's peak resident bytes
when its shards were made (VmHWM) beside the plan's parameter bytes for it, when its first
step ended (seconds since the process started), and its peak resident bytes over the run
beside the plan's peak; what building the whole model on every rank first would have held
(nproc x the fp32 weights); and the median of the steps after the first. (The resident set
counts Python and torch, about 340 MiB a rank, which the plan's device memory does not.)

Measure at low load (`uptime` is printed before and after): the ranks share this machine's
cores, and a step of the 1B model on 2 cores takes minutes. On this 24 GB machine (2026-11-28,
at 4557c64) the 1B model's FSDP8 training in bf16 with --release-host-memory trains: 8 ranks,
startup 62-64 s a rank (startup peak 770-788 MiB against the plan's 423 MiB of parameters:
the process baseline), first step done at 200-202 s, steps 2-3 at 123.5 s (122.8-124.3, load
~10), run peak 2681-2687 MiB a rank against the plan's 2884. That needs the embeddings and
the head as FSDP2 units of their own (torchtitan's layout, `runtime.data_parallel.end_units`,
priced by the plan's collectives too): in the root they stay gathered over the whole step, and
a rank was OOM-killed in its first steps. Its fp32 plan prices 3.2 GiB a rank, over the 2.9
the profile gives each of 8 ranks. Without --release-host-memory glibc's malloc keeps
freed tensors resident, about twice the plan's peak.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    "1b": {"hidden": 2048, "num_layers": 16, "ffn_hidden": 5632, "num_heads": 16,
           "num_kv_heads": 8, "vocab_size": 32000},
    "0.5b": {"hidden": 1536, "num_layers": 16, "ffn_hidden": 4096, "num_heads": 12,
             "num_kv_heads": 4, "vocab_size": 32000},
    "small": {"hidden": 768, "num_layers": 8, "ffn_hidden": 2048, "num_heads": 12,
              "num_kv_heads": 6, "vocab_size": 32000},
}  # fmt: skip
STEP_LINE = re.compile(r"^step (\d+)/\d+ .*? time ([\d.]+) s", re.M)
RANK_LINE = re.compile(
    r"rank (\d+) memory MiB: .*? peak ([\d.]+) \(plan peak ([\d.-]+)\); startup ([\d.]+) s, "
    r"peak MiB host ([\d.]+).*?\(plan's parameters ([\d.-]+)\); first step done ([\d.]+ s|-)"
)


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def import_seconds(repeats: int) -> None:
    """Print the median and spread of the CPU and wall seconds a fresh interpreter takes to
    import what every generated program imports (`autopar.codegen.program.PROGRAM_IMPORTS`):
    a fixed cost of each rank's start, paid again by every rank torchrun restarts."""
    from autopar.codegen.program import PROGRAM_IMPORTS

    code = (
        "import resource, time\nt = time.perf_counter()\n"
        + PROGRAM_IMPORTS
        + (
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(r.ru_utime + r.ru_stime, time.perf_counter() - t)"
        )
    )
    cpu, wall = [], []
    print(f"load {_load()}")
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-2000:])
        c, w = map(float, done.stdout.split()[-2:])
        cpu.append(c)
        wall.append(w)
    for name, xs in (("CPU", sorted(cpu)), ("wall (imports alone)", sorted(wall))):
        print(f"a program's imports, {name}: median {statistics.median(xs):.2f} s "
              f"({xs[0]:.2f}-{xs[-1]:.2f}, {repeats} runs)")  # fmt: skip
    print(f"load {_load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--config", default="fsdp=8 | zero=3", help="ParallelConfig text")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", help="the plan's: fp32 or bf16")
    parser.add_argument(
        "--release-host-memory",
        action="store_true",
        help="pass it to train.py: the ranks' allocator returns freed memory",
    )
    parser.add_argument("--out", help="keep the plan and program here (default: a temp dir)")
    parser.add_argument(
        "--imports", type=int, metavar="N", help="time a rank's imports alone, N times, and stop"
    )
    args = parser.parse_args()
    if args.imports:
        import_seconds(args.imports)
        return

    import autopar
    from autopar.config.text import parse_config
    from autopar.models import zoo

    overrides = dict(SIZES[args.size], seq_len=args.seq)
    model = zoo.build("llama-tiny", device="meta", **overrides)
    n_params = sum(p.numel() for p in model.parameters())
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=args.nproc)
    config = parse_config(args.config)
    (ids,) = zoo.example_inputs("llama-tiny", model, seq_len=args.seq)
    # the zoo's build records its factory and overrides: the program builds the same model
    plan = autopar.evaluate(
        model,
        cluster,
        config,
        (ids,),
        global_batch_size=args.batch,
        precision=args.precision,
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="autopar-startup-"))
    plan.save(out)
    released = " --release-host-memory" if args.release_host_memory else ""
    print(f"model: llama-tiny {args.size}, {n_params / 1e9:.3f} B parameters, "
          f"{n_params * 4 / 2**30:.2f} GiB fp32; plan {plan.config.as_text()} on "
          f"{args.nproc} CPU ranks, {args.precision}"
          f"{released}; load {_load()}")  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", str(out / "train.py"),
           "--steps", str(args.steps)]  # fmt: skip
    if args.release_host_memory:
        cmd.append("--release-host-memory")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    text = done.stdout + done.stderr
    rows = sorted(
        (int(m[0]), *(float(x) if x != "-" else float("nan") for x in m[1:6]),
         float(m[6][:-2]) if m[6] != "-" else float("nan"))
        for m in RANK_LINE.findall(text)
    )  # fmt: skip
    if done.returncode or not rows:
        print(text[-4000:])
        sys.exit(f"the program failed (exit {done.returncode})")
    print(f"{'rank':>4} {'startup s':>10} {'startup peak MiB':>17} {'plan params MiB':>16} "
          f"{'first step s':>13} {'run peak MiB':>13} {'plan peak MiB':>14}")  # fmt: skip
    for rank, run_peak, plan_peak, startup, host, planned, first in rows:
        print(f"{rank:>4} {startup:>10.1f} {host:>17.0f} {planned:>16.0f} {first:>13.1f} "
              f"{run_peak:>13.0f} {plan_peak:>14.0f}")  # fmt: skip
    peaks = [r[4] for r in rows]
    print(f"all ranks: host peak {sum(peaks) / 1024:.2f} GiB in all (max {max(peaks):.0f} MiB "
          f"a rank); the whole model on every rank would hold {args.nproc} x "
          f"{n_params * 4 / 2**30:.2f} = {args.nproc * n_params * 4 / 2**30:.1f} GiB of weights "
          f"before sharding; time to first step {max(r[6] for r in rows):.1f} s; wall "
          f"{wall:.1f} s; load {_load()}")  # fmt: skip
    times = sorted(float(t) for n, t in STEP_LINE.findall(text) if int(n) > 1)
    if times:  # the first step warms up: the later ones' median and spread
        print(f"steps 2-{len(times) + 1}: median {statistics.median(times):.2f} s a step "
              f"({times[0]:.2f}-{times[-1]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
