"""Goodput of fault-tolerant replica groups under injected failures, against checkpoint-restart.

The gpt-tiny DP2 plan of `benchmarks/goodput.py` (local_cpu, 2 ranks) run two ways on the same
work (the same steps), under the same seeded failure times (a killer thread SIGKILLs a random
worker at exponentially distributed times of mean MTBF):
- checkpoint-restart: `benchmarks/goodput.py`'s run -- one torchrun of 2 ranks, synchronous
  checkpoints at the plan's interval, every failure restarts the job from the newest one;
- fault-tolerant groups: the plan's 2 data-parallel replicas as 2 groups of one rank each,
  no checkpoints (a failure is skipped where it would leave no group healthy: see `_Killers`),
  each its own `torchrun --max-restarts` (`train.py --ft-group G --lighthouse URL
  --ft-timeout D`), torchft's lighthouse between them: a failure costs the survivor the step
  in flight and the timeout D before it drops it, then the failed group's absence (restart
  and heal) while the survivor steps on alone.

Measured goodput for the groups: committed group-steps (every group's --metrics lines) at the
failure-free step time over groups x wall time (from the first step's end to the last's).
Predicted: `estimate.algorithms.price_ft` with local_cpu's [reliability] restart_s (measured
by `benchmarks/goodput.py calibrate`) and the failures the run met (kills / wall time), D the
timeout passed; and for checkpoint-restart `benchmarks/goodput.py`'s own prediction.

    python3 benchmarks/ft_goodput.py                      # MTBF 30 s and 90 s, 200 s of work
    python3 benchmarks/ft_goodput.py --rates 30 --seconds 120
    python3 benchmarks/ft_goodput.py --rates ''                   # the failure-free steps only

It also prints torchft's own work a step in the failure-free run -- the quorum, the gradient
all-reduce over the groups and the commit, as each group's program reports them -- against
`estimate.algorithms.ft_step_cost`, and the measured difference between the groups' step and
the one job's.

Acceptance (issue 48): at two failure rates, the groups' predicted and measured goodput within
10%, beside checkpoint-restart's on the same job.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput as cr  # noqa: E402  (benchmarks/goodput.py: the checkpoint-restart side)

import autopar  # noqa: E402
from autopar.estimate.algorithms import price_ft  # noqa: E402
from autopar.plan.training import torchft_step_cost  # noqa: E402

GROUPS = 2
TIMEOUT_S = 3.0  # --ft-timeout: how long the survivor waits on a dead group's all-reduce
# the program's last line per rank: torchft's own milliseconds a step, by part
TORCHFT = re.compile(r"(quorum|gradient all-reduce|commit) ([\d.]+) ms")


def run_groups(directory: Path, steps: int, mtbf_s: float | None, seed: int) -> dict:
    """One fault-tolerant run of ``steps`` steps; every group's metrics lines and the kills."""
    from torchft._torchft import LighthouseServer  # the lighthouse, in this process

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=50
    )
    url = lighthouse.address()
    env = {**os.environ, "PYTHONPATH": str(cr.REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "RUST_LOG": "error"}  # fmt: skip
    tag = f"{mtbf_s}-{seed}-{time.time_ns()}"
    metrics = [directory / f"ft-{tag}-g{g}.jsonl" for g in range(GROUPS)]
    agents = []
    for g in range(GROUPS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               "--standalone", "--max-restarts=1000", "--monitor-interval=0.1",
               str(directory / "train.py"), "--steps", str(steps), "--ft-group", str(g),
               "--ft-groups", str(GROUPS), "--lighthouse", url,
               "--ft-timeout", str(TIMEOUT_S), "--metrics", str(metrics[g])]  # fmt: skip
        err = open(directory / f"ft-{tag}-g{g}.err", "w")  # noqa: SIM115 (the agent's)
        out = open(directory / f"ft-{tag}-g{g}.out", "w")  # noqa: SIM115 (torchft's costs)
        agents.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
    killer = _Killers([a.pid for a in agents], metrics, mtbf_s, seed) if mtbf_s else None
    if killer:
        killer.start()
    try:  # the job is done when a group has committed the last step: stop the others then
        while all(a.poll() is None for a in agents):
            time.sleep(0.2)
        failed = [g for g, a in enumerate(agents) if a.poll() not in (None, 0)]
        if failed:
            err = (directory / f"ft-{tag}-g{failed[0]}.err").read_text()
            raise RuntimeError(f"group {failed[0]} failed: {err[-2000:]}")
    finally:
        if killer:
            killer.stopped.set()
        for a in agents:
            a.kill()
        lighthouse.shutdown()
    logs = [[json.loads(x) for x in m.read_text().splitlines()] for m in metrics]
    skipped = killer.skipped if killer else 0
    costs = [
        {k: float(v) / 1e3 for k, v in TORCHFT.findall(line)}
        for g in range(GROUPS)
        for line in (directory / f"ft-{tag}-g{g}.out").read_text().splitlines()
        if "torchft a step" in line
    ]
    return {"logs": logs, "kills": killer.kills if killer else [], "skipped": skipped,
            "torchft": costs}  # fmt: skip


class _Killers(cr.Killer):
    """`goodput.Killer` over several torchrun agents: a random worker of any group, while
    another group is healthy (it committed a step in the last second: its metrics file grew).
    Without checkpoints a run of groups keeps its progress only in the live groups: a failure
    that would leave none healthy is not injected (skipped, counted), and the prediction
    assumes none happens either."""

    def __init__(self, agents: list[int], metrics: list[Path], mtbf_s: float, seed: int) -> None:
        super().__init__(agents[0], mtbf_s, seed)
        self.agents, self.metrics = agents, metrics
        self.skipped = 0

    def _healthy(self, group: int) -> bool:
        try:
            return time.time() - self.metrics[group].stat().st_mtime < 1.0
        except OSError:
            return False

    def run(self) -> None:
        while not self.stopped.wait(self.rng.expovariate(1 / self.mtbf_s)):
            group = self.rng.randrange(len(self.agents))
            workers = cr._workers(self.agents[group])
            others = [g for g in range(len(self.agents)) if g != group and self._healthy(g)]
            if not workers or not others:
                self.skipped += 1
                continue
            os.kill(self.rng.choice(workers), 9)
            self.kills.append(time.time())


def step_time(logs: list[list[dict]]) -> float:
    """The failure-free step time: the median gap between a group's consecutive steps."""
    gaps = [
        b["time"] - a["time"]
        for log in logs
        for a, b in zip(log, log[1:], strict=False)
        if b["step"] == a["step"] + 1
    ]
    return statistics.median(gaps)


def measured(logs: list[list[dict]], t_step: float, steps: int) -> tuple[float, float]:
    """(goodput, wall seconds): committed group-steps at ``t_step`` over groups x wall, from
    the first step's end to the moment a group commits the last step (the job is done then)."""
    first = min(log[0]["time"] for log in logs)
    end = min(r["time"] for log in logs for r in log if r["step"] == steps)
    wall = end - first
    done = sum(1 for log in logs for r in log if r["time"] <= end)
    useful = (done - len(logs)) * t_step  # each group's first step ends at the clock's start
    return useful / (len(logs) * wall), wall


def predicted(plan: autopar.Plan, met_mtbf_s: float, t_step: float) -> float:
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=cr.RANKS)
    rel = cluster.profile.reliability
    rate = 3600 / (met_mtbf_s * cluster.world_size)
    rel = replace(rel, failure_rate_per_device_hour=rate)
    est = price_ft(
        t_step, plan.config, 1.0, 0.0, 1.0, cluster, rel, plan.num_params, plan.optimizer,
        GROUPS, TIMEOUT_S,
    )  # fmt: skip
    return est.goodput


def print_step_cost(plan: autopar.Plan, costs: list[dict], t_ft: float, t_one: float) -> None:
    """torchft's work a step, measured (each group's medians, by part) against
    `plan.training.torchft_step_cost`'s; and the measured difference between the groups'
    step and one job's."""
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=cr.RANKS)
    control = cluster.profile.reliability.ft_control_s
    cost, reduce = torchft_step_cost(plan, cluster, control)
    parts = ("quorum", "gradient all-reduce", "commit")
    got = {k: statistics.median(c[k] for c in costs) for k in parts}
    print(f"torchft a step, measured (median of {len(costs)} groups): "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items())
          + f"; priced: all-reduce {reduce * 1e3:.2f} ms (exposed beyond the synchronous "
          f"plan's {plan.breakdown['dp_comm'] * 1e3:.2f} ms), quorum + commit "
          f"{control * 1e3:.2f} ms, {cost * 1e3:.2f} ms added in all; measured groups' step "
          f"less one job's: {(t_ft - t_one) * 1e3:.2f} ms", flush=True)  # fmt: skip
    step = plan.step_time_s + cost
    print(f"groups' failure-free step: predicted {step * 1e3:.1f} ms, measured "
          f"{t_ft * 1e3:.1f} ms ({step / t_ft - 1:+.1%})", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=200, help="work per failing run")
    parser.add_argument("--rates", default="30,90", help="MTBFs to inject, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        plan = cr.make_plan(directory)
        quiet = run_groups(directory, 200, None, 0)
        t_ft = step_time(quiet["logs"])
        steps = int(args.seconds / t_ft)
        t_cr = cr.step_time(cr.run(directory, 200, 0, None, 0, 900)["log"])
        print(f"failure-free step: groups {t_ft * 1e3:.1f} ms, one job {t_cr * 1e3:.1f} ms; "
              f"{steps} steps a run", flush=True)  # fmt: skip
        print_step_cost(plan, quiet["torchft"], t_ft, t_cr)
        rows = []
        for mtbf in (float(x) for x in args.rates.split(",") if x):
            got = run_groups(directory, steps, mtbf, args.seed)
            t_run = step_time(got["logs"])
            meas, wall = measured(got["logs"], t_run, steps)
            met = wall / max(1, len(got["kills"]))
            pred = predicted(plan, met, t_run)
            _, auto = cr.predicted(plan, mtbf, 1, t_cr)
            base = cr.run(directory, steps, auto, mtbf, args.seed, 6 * args.seconds + 600)
            t_base = cr.step_time(base["log"])
            base_meas = cr.measured_goodput(base["log"])
            base_wall = base["log"][-1]["time"] - base["log"][0]["time"]
            base_met = base_wall / max(1, len(base["kills"]))
            base_pred, _ = cr.predicted(plan, base_met, auto, t_base)
            rows.append((mtbf, len(got["kills"]), meas, pred, len(base["kills"]), base_meas,
                         base_pred))  # fmt: skip
            print(f"MTBF {mtbf:4.0f} s  groups: failures {len(got['kills']):3d} (skipped "
                  f"{got['skipped']}) measured "
                  f"{meas:.3f} predicted {pred:.3f} ({pred / meas - 1:+.1%})  |  "
                  f"checkpoint-restart every {auto}: failures {len(base['kills']):3d} measured "
                  f"{base_meas:.3f} predicted {base_pred:.3f} ({base_pred / base_meas - 1:+.1%})",
                  flush=True)  # fmt: skip
        if rows:
            worst = max(abs(r[3] / r[2] - 1) for r in rows)
            print(f"\ngroups: worst |predicted/measured - 1| {worst:.1%} (target <= 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
