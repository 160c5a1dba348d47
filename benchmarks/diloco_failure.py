"""What a failed DiLoCo group costs the others, against `estimate.algorithms.price_diloco`.

The price charges each failure R + H T / (2F) + heal for the whole job: DiLoCo's outer step
takes every group, so while the failed group restarts and redoes its steps the others wait at
their next outer step. Run here: the gpt-tiny plan of `benchmarks/goodput.py` on one rank
(local_cpu) as 2 DiLoCo groups, each its own `torchrun --max-restarts` (`train.py
--diloco-group G`, one fragment, a checkpoint every H steps), torchft's lighthouse in this
process, each step paced by PACE seconds of data loading (the data hook below) so that a step
is long against the run's noise. One run without failures gives T; then, for each kill point
k, group 1's worker is SIGKILLed once its metrics show step H + k committed (k steps into the
second outer period): torchrun restarts it, it resumes from its checkpoint at the period's
start, redoes the steps to the period's end and is healed there by group 0, which has waited
at that outer step since it got there.

Measured: group 0's stall, its step that takes the outer step less the same step of the run
without failures; and group 1's own parts of it: its restart (from the kill to its first step
again, less a step) and its rejoining (its step into the outer step, where it meets the others'
quorum and is healed, less that step of the run without failures). Predicted for a kill after
k of the period's steps: R + k T + J + heal, with R the profile's restart_s
(`benchmarks/goodput.py calibrate`), J its rejoin_s (measured here: the median of the printed
rejoins) and heal `algorithms._heal_s`; over kills spread evenly across the period that is the
price's R + H T / 2 + J + heal.

    python3 benchmarks/diloco_failure.py                  # H = 8, kills after 2 and 6 steps
    python3 benchmarks/diloco_failure.py --kills 1,4,7 --inner-steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput as cr  # noqa: E402  (benchmarks/goodput.py: the plan, torchrun's workers)

import autopar  # noqa: E402
from autopar.estimate.algorithms import _group_link, _heal_s  # noqa: E402
from autopar.models import zoo  # noqa: E402

PACE_ENV = "AUTOPAR_BENCH_PACE_S"
VOCAB, SEQ = 128, 32  # gpt-tiny's


def make_plan(directory: Path) -> autopar.Plan:
    """goodput.py's gpt-tiny plan for one group of one rank (a DiLoCo group's share of the
    batch: the program multiplies it by the groups), saved with its train.py."""
    model = zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=1)
    plan = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(micro_batch_size=cr.BATCH // 2),
        zoo.example_inputs("gpt-tiny", model), global_batch_size=cr.BATCH // 2,
        precision="fp32",
    )  # fmt: skip
    plan.save(directory)
    return plan


def paced(step: int, start: int, stop: int):
    """The data hook: seeded token ids, after PACE seconds (a slow loader)."""
    time.sleep(float(os.environ.get(PACE_ENV, "0")))
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (cr.BATCH, SEQ + 1), generator=g)[start:stop]
    return (ids[:, :-1],), ids[:, 1:]


def run(directory: Path, steps: int, h: int, pace: float, kill_after: int | None) -> list:
    """Each group's metrics lines; group 1's worker killed once it committed ``kill_after``."""
    from torchft._torchft import LighthouseServer  # the lighthouse, in this process

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=10000, quorum_tick_ms=50
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cr.REPO), str(Path(__file__).parent)]),
           "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "RUST_LOG": "error", PACE_ENV: str(pace)}  # fmt: skip
    tag = f"{kill_after}-{time.time_ns()}"
    metrics = [directory / f"dl-{tag}-g{g}.jsonl" for g in (0, 1)]
    agents = []
    for g in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               "--standalone", "--max-restarts=3", "--monitor-interval=0.1",
               str(directory / "train.py"), "--steps", str(steps), "--diloco-group", str(g),
               "--diloco-groups", "2", "--inner-steps", str(h), "--lighthouse",
               lighthouse.address(), "--data", "diloco_failure:paced",
               "--checkpoint-dir", str(directory / f"ck-{tag}-g{g}"),
               "--checkpoint-every", str(h), "--metrics", str(metrics[g])]  # fmt: skip
        err = open(directory / f"dl-{tag}-g{g}.err", "w")  # noqa: SIM115 (the agent's)
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
    killed = kill_after is None
    try:
        while any(a.poll() is None for a in agents):
            if not killed and _committed(metrics[1]) >= kill_after:
                workers = cr._workers(agents[1].pid)
                if workers:
                    os.kill(workers[0], 9)
                    killed = True
            time.sleep(0.01)
        failed = [g for g, a in enumerate(agents) if a.returncode != 0]
        if failed:
            err = (directory / f"dl-{tag}-g{failed[0]}.err").read_text()
            raise RuntimeError(f"group {failed[0]} failed: {err[-2000:]}")
    finally:
        for a in agents:
            a.kill()
        lighthouse.shutdown()
    return [[json.loads(x) for x in m.read_text().splitlines()] for m in metrics]


def _committed(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def _gap_into(log: list[dict], step: int) -> float:
    """Seconds from the end of ``step`` - 1 to the end of ``step`` in one group's log (its
    last run of them: a restarted group redoes steps)."""
    ends = {r["step"]: r["time"] for r in log}
    return ends[step] - ends[step - 1]


def step_time(log: list[dict]) -> float:
    """The median gap between consecutive steps of one group's run."""
    return statistics.median(b["time"] - a["time"] for a, b in zip(log, log[1:], strict=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--kills", default="2,6", help="kill group 1 after these steps of "
                        "the second outer period")  # fmt: skip
    parser.add_argument("--pace", type=float, default=0.25, help="seconds a step's data takes")
    args = parser.parse_args(argv)
    h = args.inner_steps
    steps = 3 * h
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        plan = make_plan(directory)
        quiet = run(directory, steps, h, args.pace, None)
        t = step_time(quiet[0])
        base = _gap_into(quiet[0], 2 * h)  # the outer step's own cost is in both runs
        base_1 = _gap_into(quiet[1], 2 * h)  # group 1's, without its rejoining
        cluster = autopar.Cluster.from_profile("local_cpu", num_devices=1)
        restart = cluster.profile.reliability.restart_s
        rejoin = cluster.profile.reliability.rejoin_s
        heal = _heal_s(plan.num_params, plan.optimizer, _group_link(cluster, 1))
        print(f"failure-free: step {t:.3f} s (pace {args.pace} s), step {2 * h} with its outer "
              f"step {base:.3f} s; priced: restart {restart:.2f} s, rejoin {rejoin:.2f} s, heal "
              f"{heal * 1e3:.1f} ms", flush=True)  # fmt: skip
        errors, rejoins = [], []
        for k in (int(x) for x in args.kills.split(",") if x):
            survivor, failed = run(directory, steps, h, args.pace, h + k)
            stall = _gap_into(survivor, 2 * h) - base
            # the failed group's own restart: its kill came as it committed step h + k
            lost = next(r["time"] for r in failed if r["step"] == h + k)
            again = next(r["time"] for r in failed if r["time"] > lost and r["step"] == h + 1)
            rejoins.append(_gap_into(failed, 2 * h) - base_1)
            want = restart + k * t + rejoin + heal
            errors.append(want / stall - 1)
            print(f"killed after {k} of the period's {h} steps: group 0 waited {stall:.2f} s "
                  f"more at step {2 * h}, predicted {want:.2f} s ({want / stall - 1:+.1%}); "
                  f"group 1's restart took {again - lost - t:.2f} s, its rejoining "
                  f"{rejoins[-1]:.2f} s", flush=True)  # fmt: skip
        if errors:
            print(
                f"\nper failure, the price's mean: {restart + h * t / 2 + rejoin + heal:.2f} s "
                f"(R + H T / 2 + J + heal); worst |predicted/measured - 1| "
                f"{max(abs(e) for e in errors):.1%}; rejoining measured: median "
                f"{statistics.median(rejoins):.2f} s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
