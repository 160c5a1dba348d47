"""Run saved plans' generated programs on local CPU ranks and read back their step times.

In: a world size and a list of `Program`s (a key and a directory written by `plan.save`, with
its `train.py`). Out: per key a `Measured`: the step times rank 0 printed (`step k/n ... time
X s`, the line `autopar.runtime.trainer` writes beside the plan's prediction), or the error.

Two launchers:
    "pool"      (default) one spawn of N gloo ranks runs every program in turn: each rank
                imports the program's train.py as a module and calls its main() with
                `--steps K`, exactly as torchrun would, on a default process group made
                fresh for that program (over one TCPStore) and destroyed after it, with every
                group the program made (`autopar.runtime.mesh.init_distributed` reuses it).
                Starting N Python processes that import torch costs seconds on a shared
                2-core machine, more than the run itself, so they are started once per
                world size.
    "torchrun"  one `torchrun --standalone --nproc-per-node=N train.py --steps K` per
                program: what a user runs; slower.

Threads: every rank computes with ``threads`` intra-op threads (`torch.set_num_threads` and
OMP_NUM_THREADS), so that the rates a hardware profile measured per rank are those the ranks
run at. A program that fails on every rank alike (a config the runtime refuses) is recorded
and the pool goes on; one that hangs past ``timeout_s`` costs the pool: it is killed, the
program marked, and a new pool runs the rest.

Public:
    Program, Measured
    measure(world_size, programs, *, steps, threads=1, launcher="pool", timeout_s=120.0)
    parse_step_times(text) -> list[float]
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autopar.runtime.mesh import free_port, rank_environment

_STEP_LINE = re.compile(r"^step (\d+)/(\d+) .*?time ([0-9.eE+-]+) s", re.MULTILINE)


@dataclass(frozen=True)
class Program:
    key: str
    directory: str  # holds train.py and plan.json (plan.save)


@dataclass(frozen=True)
class Measured:
    step_times_s: tuple[float, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.step_times_s)


def parse_step_times(text: str) -> list[float]:
    """The step times, in step order, of the `step k/n ... time X s` lines in ``text``."""
    return [float(m.group(3)) for m in _STEP_LINE.finditer(text)]


def measure(
    world_size: int,
    programs: list[Program],
    *,
    steps: int,
    threads: int = 1,
    launcher: str = "pool",
    timeout_s: float = 120.0,
) -> dict[str, Measured]:
    """Run every program for ``steps`` steps on ``world_size`` CPU ranks (module docstring)."""
    if launcher == "torchrun":
        return {p.key: _torchrun(world_size, p, steps, threads, timeout_s) for p in programs}
    if launcher != "pool":
        raise ValueError(f"launcher must be 'pool' or 'torchrun', got {launcher!r}")
    out: dict[str, Measured] = {}
    todo = list(programs)
    while todo:
        got = _pool(world_size, todo, steps, threads, timeout_s)
        out.update(got)
        todo = [p for p in todo if p.key not in out]
    return out


# ---------------------------------------------------------------- torchrun, one per program


def _torchrun(
    world_size: int, program: Program, steps: int, threads: int, timeout_s: float
) -> Measured:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        str(Path(program.directory, "train.py")),
        "--steps",
        str(steps),
        "--device",
        "cpu",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return Measured(error=f"timed out after {timeout_s:.0f} s")
    times = parse_step_times(done.stdout)
    if done.returncode or len(times) != steps:
        return Measured(error=_last_error(done.stdout + done.stderr))
    return Measured(tuple(times))


def _last_error(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if "Error" in x or "error" in x]
    return (lines[-1] if lines else text.strip().splitlines()[-1:] or ["failed"])[0][:300]


# ---------------------------------------------------------------- the pool


def _pool(
    world_size: int, programs: list[Program], steps: int, threads: int, timeout_s: float
) -> dict[str, Measured]:
    """One spawn of ``world_size`` ranks over ``programs``; what it finished (the program it
    hung or died on is marked failed, the rest left for the caller to run again)."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "results.jsonl")
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), programs, steps, threads, timeout_s, str(log)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        failure = None
        last_progress, seen = time.monotonic(), 0
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except Exception as e:  # a rank died: the rest of the pool is lost
                failure = f"rank died: {str(e).strip().splitlines()[-1][:200]}"
                break
            count = len(log.read_text().splitlines()) if log.exists() else 0
            if count != seen:
                seen, last_progress = count, time.monotonic()
            if time.monotonic() - last_progress > timeout_s + 60:
                failure = f"no progress for {timeout_s + 60:.0f} s"
                break
        if failure:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        out: dict[str, Measured] = {}
        started = None
        for line in log.read_text().splitlines() if log.exists() else []:
            row = json.loads(line)
            if "start" in row:
                started = row["start"]
            else:
                out[row["key"]] = Measured(tuple(row["times"]), row["error"])
                started = None
        if failure:
            stuck = started or next((p.key for p in programs if p.key not in out), None)
            if stuck is not None:
                out[stuck] = Measured(error=failure)
        return out


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    programs: list[Program],
    steps: int,
    threads: int,
    timeout_s: float,
    log: str,
) -> None:
    os.environ.update(rank_environment(rank, world_size, port), OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    # a file beside the log, not a TCP port: a port found free beforehand can be taken by
    # another process (a test on another pytest-xdist worker) before rank 0 listens on it
    store = dist.FileStore(f"{log}.store", world_size)
    store.set_timeout(timeout)
    for index, program in enumerate(programs):
        # A fresh default group per program, as torchrun gives each run: the groups a
        # program's DeviceMesh makes are never destroyed while the default group lives, and
        # every gloo group keeps its threads and sockets; 30 programs into one pool a step
        # measured 20% slower than on a fresh one (2026-11-22, pp4 on 4 ranks).
        # destroy_process_group() takes the default group and every group made from it.
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"program{index}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        if rank == 0:
            _append(log, {"start": program.key})
        text, error = _run_module(program, index, steps)
        dist.barrier()  # every rank done with this program (also after a refusal)
        if rank == 0:
            times = parse_step_times(text)
            if error is None and len(times) != steps:
                error = f"printed {len(times)} step times, expected {steps}"
            _append(log, {"key": program.key, "times": times, "error": error})
        dist.destroy_process_group()
        gc.collect()


def _run_module(program: Program, index: int, steps: int) -> tuple[str, str | None]:
    """Import the program's train.py and run its main() with ``--steps``; (stdout, error)."""
    path = Path(program.directory, "train.py")
    spec = importlib.util.spec_from_file_location(f"autopar_program_{index}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    buffer, error = io.StringIO(), None
    argv = sys.argv
    sys.argv = [str(path), "--steps", str(steps), "--device", "cpu"]
    try:
        with contextlib.redirect_stdout(buffer):
            spec.loader.exec_module(module)
            module.main()
    except Exception as e:  # recorded, the pool goes on with the next program
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    finally:
        sys.argv = argv
    return buffer.getvalue(), error


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
