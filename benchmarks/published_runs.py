"""Predicted vs published step times of the runs in data/calibration_runs.csv.

    python3 benchmarks/published_runs.py                  # trace, evaluate, table, summary
    python3 benchmarks/published_runs.py --dry-run        # mapping and measured step only
    python3 benchmarks/published_runs.py --rows kor22 --json out.json

In: the csv rows, interpreted by `published_runs_mapping` (model shape, shipped hardware
profile, `ParallelConfig`, cost options, measured seconds per step). Each run's model is the
zoo's GPT built on the meta device from the row's dimensions, traced once per model shape, and
priced with `autopar.evaluate` on the matching profile. Out: one line per row (predicted and
measured step time, error = predicted / measured - 1, predicted MFU and measured MFU under our
own `model_flops`), the largest terms of each plan's breakdown, and the median and worst
absolute error over the [A] rows and over all evaluated rows.
Targets (issue): on the [A] rows, median |error| <= 10% and worst |error| <= 25%.

Nothing here is fitted: the efficiency parameters live in hardware_profiles/ and the cost
model; a miss is reported, not corrected per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from published_runs_mapping import (
    DEFAULT_CSV,
    MCORE_TP_COMM_OVERLAP,
    PublishedRun,
    measured_mfu,
    megatron_2021_eq3_flops,
    read_runs,
    source_tflops_from_step,
)

import autopar

TARGET_MEDIAN = 0.10
TARGET_WORST = 0.25


@dataclass(frozen=True)
class Result:
    """One evaluated (or skipped) row."""

    id: str
    tag: str
    num_devices: int
    profile: str
    config: str
    measured_step_s: float | None
    measured_from: str
    measured_mfu: float | None
    predicted_step_s: float | None = None
    predicted_mfu: float | None = None
    peak_memory_bytes: float | None = None
    breakdown: dict[str, float] | None = None
    skipped: str | None = None

    @property
    def error(self) -> float | None:
        if self.predicted_step_s is None or not self.measured_step_s:
            return None
        return self.predicted_step_s / self.measured_step_s - 1.0


def peak_flops(run: PublishedRun) -> float:
    return autopar.load_profile(run.profile).device.peak(run.precision)


# ---------------------------------------------------------------------------------------------
# Dry run: the mapping and the measured step time, with cross-checks.


def print_dry_run(runs: list[PublishedRun]) -> None:
    print(
        f"{'id':<30} {'tag':<3} {'N':>5} {'profile':<12} {'prec':<4} {'config':<40} "
        f"{'meas s':>8}  {'from':<34} {'params':>7} {'MFU ours':>8} {'csv MFU':>7} "
        f"{'src TF/s':>8} {'csv TF/s':>8} {'eq3 %pk':>7} {'csv HFU':>7}"
    )
    for run in runs:
        mfu = measured_mfu(run, peak_flops(run))
        src_tf = source_tflops_from_step(run)
        eq3 = None
        if run.measured_step_s is not None:
            flops = megatron_2021_eq3_flops(run.dims, run.global_batch_seqs)
            eq3 = flops / (run.measured_step_s * run.num_devices * peak_flops(run))
        params = run.dims.num_params() / 1e9
        params_err = f"{params / run.published_params_b - 1:+.1%}" if run.published_params_b else ""
        config = run.config_text() if run.skip_reason is None else f"SKIP: {run.config_text()}"
        print(
            f"{run.id:<30} {run.tag:<3} {run.num_devices:>5} {run.profile:<12} "
            f"{run.precision:<4} {config:<40} {_num(run.measured_step_s, 8, 3)}  "
            f"{run.measured_from:<34} {params_err:>7} {_pct(mfu, 8)} "
            f"{_num(run.mfu_pct, 7, 1)} {_num(src_tf, 8, 1)} {_num(run.tflops_per_device, 8, 1)} "
            f"{_pct(eq3, 7)} {_num(run.hfu_pct, 7, 1)}"
        )
    print("\nmodel shapes, assumptions and skips")
    for run in runs:
        print(f"  {run.id}: {run.dims.as_text()}")
        for note in run.assumptions:
            print(f"      - {note}")
        if run.skip_reason:
            print(f"      ! skipped: {run.skip_reason}")


# ---------------------------------------------------------------------------------------------
# Evaluation: trace once per model shape, evaluate every row of that shape.


def evaluate_all(runs: list[PublishedRun], tp_comm_overlap: float) -> list[Result]:
    from autopar.estimate import CostOptions
    from autopar.models import zoo

    results: dict[str, Result] = {}
    todo = []
    for run in runs:
        base = _result(run)
        if run.skip_reason is not None:
            results[run.id] = base
            print(f"skip {run.id}: {run.skip_reason}", file=sys.stderr)
        else:
            todo.append(run)
    by_shape: dict[tuple, list[PublishedRun]] = {}
    for run in todo:
        key = tuple(sorted(run.dims.gpt_overrides().items()))
        by_shape.setdefault(key, []).append(run)
    for i, (key, group) in enumerate(by_shape.items(), 1):
        overrides = dict(key)
        t0 = time.perf_counter()
        model = zoo.build("gpt-tiny", device="meta", **overrides)
        inputs = zoo.example_inputs("gpt-tiny", model)
        graph = autopar.trace(model, inputs)
        print(
            f"[{i}/{len(by_shape)}] traced {group[0].dims.as_text()} "
            f"({graph.num_params / 1e9:.2f} B params) in {time.perf_counter() - t0:.1f} s; "
            f"{len(group)} row(s)",
            file=sys.stderr,
        )
        for run in group:
            options = run.cost_options_kwargs()
            if run.source_key == "mcore24":
                options["tp_comm_overlap"] = tp_comm_overlap
            results[run.id] = _evaluate_one(
                run, model, inputs, graph, CostOptions(**options), _result(run)
            )
        del model, graph
    return [results[run.id] for run in runs]


def _evaluate_one(
    run: PublishedRun, model: Any, inputs: Any, graph: Any, options: Any, base: Result
) -> Result:
    """Price one run on its profile; a config autopar rejects becomes a skipped row."""
    cluster = autopar.Cluster.from_profile(run.profile, num_devices=run.num_devices)
    config = autopar.ParallelConfig(**run.parallel_config_kwargs())
    problems = config.problems(cluster)
    if problems:
        why = "invalid ParallelConfig: " + "; ".join(problems)
        print(f"skip {run.id}: {why}", file=sys.stderr)
        return _replace(base, skipped=why)
    t0 = time.perf_counter()
    try:
        plan = autopar.evaluate(
            model,
            cluster,
            config,
            inputs,
            global_batch_size=run.global_batch_seqs,
            precision=run.precision,
            optimizer="adamw",
            options=options,
            graph=graph,
        )
    except autopar.AutoparError as exc:  # a config autopar rejects: report, go on
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        print(f"skip {run.id}: {why}", file=sys.stderr)
        return _replace(base, skipped=why)
    print(f"    {run.id}: evaluated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return _replace(
        base,
        predicted_step_s=plan.step_time_s,
        predicted_mfu=plan.mfu,
        peak_memory_bytes=plan.peak_memory_bytes,
        breakdown=dict(plan.breakdown),
    )


def _result(run: PublishedRun) -> Result:
    return Result(
        id=run.id,
        tag=run.tag,
        num_devices=run.num_devices,
        profile=run.profile,
        config=run.config_text(),
        measured_step_s=run.measured_step_s,
        measured_from=run.measured_from,
        measured_mfu=measured_mfu(run, peak_flops(run)),
        skipped=run.skip_reason,
    )


def _replace(result: Result, **changes: Any) -> Result:
    return Result(**{**asdict(result), **changes})


# ---------------------------------------------------------------------------------------------
# Output.


def print_table(results: list[Result]) -> None:
    print(
        f"{'id':<30} {'tag':<3} {'N':>5} {'config':<40} {'pred s':>8} {'meas s':>8} "
        f"{'error':>7} {'pred MFU':>8} {'meas MFU':>8} {'mem GB':>6}"
    )
    for r in results:
        if r.skipped:
            print(f"{r.id:<30} {r.tag:<3} {r.num_devices:>5} skipped: {r.skipped}")
            continue
        mem = r.peak_memory_bytes / 1e9 if r.peak_memory_bytes is not None else None
        print(
            f"{r.id:<30} {r.tag:<3} {r.num_devices:>5} {r.config:<40} "
            f"{_num(r.predicted_step_s, 8, 3)} {_num(r.measured_step_s, 8, 3)} "
            f"{_signed_pct(r.error, 7)} {_pct(r.predicted_mfu, 8)} {_pct(r.measured_mfu, 8)} "
            f"{_num(mem, 6, 1)}"
        )


def print_breakdowns(results: list[Result], top: int = 5) -> None:
    print(f"\nlargest breakdown terms per row (seconds; top {top})")
    for r in results:
        if not r.breakdown:
            continue
        terms = sorted(r.breakdown.items(), key=lambda kv: -abs(kv[1]))[:top]
        text = "  ".join(f"{name} {sec:.3g}" for name, sec in terms)
        print(f"  {r.id:<30} {text}")


def summarize(results: list[Result]) -> dict[str, dict[str, object]]:
    """Count, median and worst |error| for the [A] rows and for all evaluated rows."""
    out: dict[str, dict[str, object]] = {}
    for label, keep in (("[A]", lambda r: r.tag == "[A]"), ("all", lambda r: True)):
        rows = [r for r in results if r.error is not None and keep(r)]
        if not rows:
            out[label] = {"count": 0}
            continue
        worst = max(rows, key=lambda r: abs(r.error))
        out[label] = {
            "count": len(rows),
            "median_abs_error": statistics.median(abs(r.error) for r in rows),
            "worst_abs_error": abs(worst.error),
            "worst_id": worst.id,
        }
    return out


def print_summary(summary: dict[str, dict[str, object]]) -> None:
    print()
    for label, s in summary.items():
        if not s["count"]:
            print(f"{label:<4} rows: none evaluated")
            continue
        print(
            f"{label:<4} rows: {s['count']:>2}  median |error| {s['median_abs_error']:6.1%}  "
            f"worst |error| {s['worst_abs_error']:6.1%} ({s['worst_id']})"
        )
    a = summary["[A]"]
    if a["count"]:
        ok_median = a["median_abs_error"] <= TARGET_MEDIAN
        ok_worst = a["worst_abs_error"] <= TARGET_WORST
        print(
            f"targets on [A]: median <= {TARGET_MEDIAN:.0%}: {'met' if ok_median else 'NOT met'};"
            f" worst <= {TARGET_WORST:.0%}: {'met' if ok_worst else 'NOT met'}"
        )


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else " " * (width - 1) + "-"


def _pct(x: float | None, width: int) -> str:
    return f"{x:>{width}.1%}" if x is not None else " " * (width - 1) + "-"


def _signed_pct(x: float | None, width: int) -> str:
    return f"{x:>+{width}.1%}" if x is not None else " " * (width - 1) + "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="calibration_runs.csv")
    parser.add_argument("--dry-run", action="store_true", help="mapping + measured step only")
    parser.add_argument("--rows", default="", help="only rows whose id contains this")
    parser.add_argument("--json", type=Path, help="write the per-row results here")
    parser.add_argument(
        "--tp-comm-overlap",
        type=float,
        default=MCORE_TP_COMM_OVERLAP,
        help="fraction of TP communication hidden on the Megatron-Core 2024 rows (one value)",
    )
    args = parser.parse_args(argv)
    runs = [r for r in read_runs(args.csv) if args.rows in r.id]
    if not runs:
        print(f"no rows match {args.rows!r}", file=sys.stderr)
        return 1
    if args.dry_run:
        print_dry_run(runs)
        results = [_result(r) for r in runs]
    else:
        results = evaluate_all(runs, args.tp_comm_overlap)
        print_table(results)
        print_breakdowns(results)
        summary = summarize(results)
        print_summary(summary)
    if args.json:
        rows = [{**asdict(r), "error": r.error} for r in results]
        payload = {"rows": rows}
        if not args.dry_run:
            payload["summary"] = summary
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
