"""Aceso's plans stage by stage: predicted against what each stage's rank measured.

data/aceso_stages.json holds, for the stages of the first node of each Aceso run, what one of
their ranks measured in the step published_grids.csv reports (Megatron's forward and backward
compute timers, PyTorch's peak reserved bytes). Every plan on a shipped profile is priced by
`Estimator.evaluate_stages` (`aceso_plans.price_plan`) and compared per stage: compute, the
stage's forward + backward over the step (its tensor-parallel collectives included, as
Megatron's compute timers include them), and memory, the stage's peak against the allocator's
peak reserved. Printed: one line per stage (with the same stage's compute in the source's other
runs of the plan, where more than 2% apart: data/aceso_stages.json `runs`), then the median and
worst |error| of each (memory also Aceso's own prediction of it); per run also its step against
what Aceso's own cost model predicted when its search chose the plan (the info csv beside its
config: the slowest stage's time), with both models' median and worst error and how far the plan
each prices fastest in a grid measures from the grid's best. Per multi-node run also its wait
per micro-batch: the step less the busiest measured stage's compute, over the micro-batches,
against the priced step less the busiest stage's (the bubble, the sends between stages, the
optimizer), where the hops between nodes show, with how many of the stage boundaries lie between
nodes.

    python3 benchmarks/aceso_stages.py
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aceso_plans import load_plans, price_plan  # noqa: E402
from published_grids import _model  # noqa: E402
from published_grids_mapping import read_grids  # noqa: E402

import autopar  # noqa: E402

GiB = 2**30
# whose step predictions are set beside the measured, as the per-run lines name them
MODELS = {"Aceso": "Aceso's own prediction", "autopar": "autopar's"}


def main() -> int:
    runs = [r for r in read_grids() if r.stage_plan and r.profile and not r.skip]
    plans = load_plans()
    compute, memory, graphs = [], [], {}
    memory_aceso = []  # Aceso's own prediction of each measured stage's peak
    waits: dict[str, list[float]] = {}  # testbed -> priced over measured wait
    # per grid (one batch and cluster), each run's step: measured, Aceso's and autopar's
    grids: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        if run.dims not in graphs:
            graphs[run.dims] = autopar.trace(*_model(run))
        cluster = autopar.Cluster.from_profile(run.profile, num_devices=run.num_devices)
        options = autopar.load_stack(run.stack).options
        estimate, _ = price_plan(run, graphs[run.dims], cluster, options)
        m = estimate.num_microbatches
        print(f"{run.id} ({estimate.notes[0].split(': ')[1]}), m = {m}")
        theirs = [s["aceso_predicted"]["step_s"] for s in plans[run.stage_plan]["stages"]
                  if "aceso_predicted" in s]  # fmt: skip
        if theirs and run.measured_step_s:  # Aceso's: the step as its slowest stage sees it
            step = {"measured": run.measured_step_s, "Aceso": max(theirs),
                    "autopar": estimate.step_time_s}  # fmt: skip
            grids.setdefault(run.grid, []).append(step)
            print(f"  step measured {step['measured']:7.2f} s; " + ", ".join(
                f"{label} {step[who]:7.2f} s {step[who] / step['measured'] - 1:+6.1%}"
                for who, label in MODELS.items()))  # fmt: skip
        for i, stage in enumerate(plans[run.stage_plan]["stages"]):
            measured = stage.get("measured")
            if measured is None:
                continue
            priced = estimate.stages[i]
            busy = m * (priced.forward_s + priced.backward_s)
            busy_meas = measured["forward_compute_s"] + measured["backward_compute_s"]
            peak, peak_meas = priced.memory.total_bytes, measured["max_reserved_bytes"]
            compute.append(busy / busy_meas - 1)
            memory.append(peak / peak_meas - 1)
            memory_aceso.append(stage["aceso_predicted"]["memory_bytes"] / peak_meas - 1)
            others = [  # the same stage in the source's other runs of the plan, where apart
                run_s["compute_s"][str(i)]
                for run_s in plans[run.stage_plan].get("runs", ())
                if abs(run_s["compute_s"].get(str(i), busy_meas) / busy_meas - 1) > 0.02
            ]
            again = "".join(f"; another run {s:.1f} s {busy / s - 1:+.1%}" for s in others)
            print(f"  stage {i:2d} tp{stage['tp']} dp{stage['dp']}: compute {busy:6.1f} s "
                  f"measured {busy_meas:6.1f} s {compute[-1]:+6.1%}; memory {peak / GiB:5.1f} "
                  f"GiB measured {peak_meas / GiB:5.1f} GiB {memory[-1]:+6.1%}{again}")  # fmt: skip
        if run.num_devices > cluster.devices_per_node and run.measured_step_s:
            busiest_meas = max(
                s["measured"]["forward_compute_s"] + s["measured"]["backward_compute_s"]
                for s in plans[run.stage_plan]["stages"]
                if "measured" in s
            )
            busiest = max(m * (s.forward_s + s.backward_s) for s in estimate.stages)
            wait_meas = (run.measured_step_s - busiest_meas) / m
            wait = (estimate.step_time_s - busiest) / m
            waits.setdefault(run.profile, []).append(wait / wait_meas)
            sizes = [s["tp"] * s["dp"] for s in plans[run.stage_plan]["stages"]]
            nodes = [cluster.node_of(r) for r in itertools.accumulate(sizes[:-1], initial=0)]
            crossings = sum(a != b for a, b in itertools.pairwise(nodes))
            print(f"  wait per micro-batch {wait * 1e3:5.1f} ms, measured {wait_meas * 1e3:5.1f} "
                  f"ms (the step less the busiest first-node stage); {crossings} of "
                  f"{len(sizes) - 1} stage boundaries between nodes")  # fmt: skip
    for testbed, ratios in waits.items():
        print(f"wait per micro-batch, {testbed}: priced over measured, median "
              f"{statistics.median(ratios):.2f} over {len(ratios)} multi-node runs")  # fmt: skip
    for who in MODELS:
        errors = [r[who] / r["measured"] - 1 for rows in grids.values() for r in rows]
        # each grid's pick: the plan the model prices fastest, measured against the grid's best
        picks = [min(rows, key=lambda r: r[who])["measured"] / min(r["measured"] for r in rows)
                 - 1 for rows in grids.values() if len(rows) > 1]  # fmt: skip
        print(f"step, {who}'s cost model: {len(errors)} plans, median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%}, worst "
              f"{max(errors, key=abs):+.1%}; its pick in each of {len(picks)} grids: "
              f"median {statistics.median(picks):+.1%}, worst {max(picks):+.1%} from the "
              "best")  # fmt: skip
    figures = (("compute", compute), ("memory", memory), ("memory, Aceso's own", memory_aceso))
    for name, errors in figures:
        worst = max(errors, key=abs)
        print(f"{name}: {len(errors)} stages, median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%}, worst {worst:+.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
