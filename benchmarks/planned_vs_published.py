"""parallelize() against the published configurations of calibration_runs.csv.

    python3 benchmarks/planned_vs_published.py [--rows PATTERN]

For each row with a full configuration: the same model, cluster, batch, precision and framework
options; `evaluate` prices the published configuration, `parallelize` searches the space; the
ratio planned / published predicted step time must be <= 1 (issue 5). Prints the ratio per row
and the median, and the planner's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from published_runs_mapping import read_runs  # noqa: E402

import autopar  # noqa: E402
from autopar.estimate import CostOptions  # noqa: E402
from autopar.models import zoo  # noqa: E402
from autopar.solve import PlanOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="")
    args = parser.parse_args()
    runs = [r for r in read_runs() if r.skip_reason is None and args.rows in r.id]
    graphs: dict[tuple, object] = {}
    ratios = []
    print(
        f"{'id':<30} {'published config':<44} {'pub s':>8} {'planned config':<62} "
        f"{'plan s':>8} {'ratio':>6} {'wall s':>6}"
    )
    for run in runs:
        key = tuple(sorted(run.dims.gpt_overrides().items()))
        if key not in graphs:
            model = zoo.build("gpt-tiny", device="meta", **dict(key))
            graphs[key] = (model, autopar.trace(model, zoo.example_inputs("gpt-tiny", model)))
        model, graph = graphs[key]
        cluster = autopar.Cluster.from_profile(run.profile, num_devices=run.num_devices)
        cost = CostOptions(**run.cost_options_kwargs())
        published = autopar.ParallelConfig(**run.parallel_config_kwargs())
        pub = autopar.evaluate(
            model, cluster, published, global_batch_size=run.global_batch_seqs,
            precision=run.precision, options=cost, graph=graph,
        )  # fmt: skip
        mbs = tuple(sorted({1, 2, 4, 8, published.micro_batch_size}))
        t0 = time.perf_counter()
        try:
            plan = autopar.parallelize(
                model, cluster, global_batch_size=run.global_batch_seqs, precision=run.precision,
                options=PlanOptions(cost=cost, micro_batch_sizes=mbs), graph=graph,
            )  # fmt: skip
        except autopar.AutoparError as e:
            print(f"{run.id:<30} planner failed: {e}")
            continue
        wall = time.perf_counter() - t0
        ratio = plan.step_time_s / pub.step_time_s
        ratios.append(ratio)
        print(
            f"{run.id:<30} {published.as_text()[:44]:<44} {pub.step_time_s:8.3f} "
            f"{plan.config.as_text()[:62]:<62} {plan.step_time_s:8.3f} {ratio:6.3f} {wall:6.1f}",
            flush=True,
        )
    if ratios:
        worse = sum(r > 1 + 1e-9 for r in ratios)
        print(
            f"\nrows {len(ratios)}: median planned/published {statistics.median(ratios):.3f}, "
            f"max {max(ratios):.3f}; rows where the plan is slower than the published: {worse}"
        )


if __name__ == "__main__":
    main()
