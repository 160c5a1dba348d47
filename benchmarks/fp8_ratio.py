"""FP8 and MXFP8 against BF16 on the published grids: the speed-up predicted and measured.

Every FP8 / MXFP8 / NVFP4 row of data/published_grids.csv that autopar can express is priced on
its own stack with its recipe (`autopar.config.precision`); a row whose grid holds a BF16 row
of the same parallel degrees is paired with it, and the measured FP8-over-BF16 speed-up
(device-seconds per token) is set against the predicted one. Printed: the pairs, then the
FP8 rows' step-time errors and peaks, then two summary lines against issue 18's targets (ratio
within 10% on every pair; FP8 rows' median |error| <= 10%) and one on the FP8 rows' measured
peaks (no target of its own; the rows predicted more than 10% under theirs).

    python3 benchmarks/fp8_ratio.py [--grid PREFIX]
    python3 benchmarks/fp8_ratio.py --fit RECIPE     # its gemm_efficiency over the pairs
    python3 benchmarks/fp8_ratio.py --auto           # Llama 3.1 70B, precision="auto"

--auto plans Llama 3.1 70B (the Hugging Face preset, 4M tokens a step) on 8 DGX H100 and on
8 DGX A100 nodes with precision="auto" and prints what each picked and why (about 80 s).

The fit is one number per recipe over every pair at once (a grid search of the mean |log|
ratio error), never a per-row value.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_grids import TARGET_MEMORY, Priced, price  # noqa: E402
from published_grids_mapping import GiB, GridRun, read_grids  # noqa: E402

from autopar.config import precision as precisions  # noqa: E402

TARGET_RATIO, TARGET_MEDIAN = 0.10, 0.10
LOW = ("fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4")


def _degrees(run: GridRun) -> tuple:
    c = run.config
    return (c.dp, c.fsdp, c.cp, c.tp, c.pp, c.ep, run.num_devices)


def _workload(grid: str) -> str:
    """A grid's id without a precision suffix: the DGX Cloud rows put a workload's BF16 and
    FP8 runs in sibling grids (`..._BF16`, `..._FP8`; data/README.md)."""
    for suffix in ("_BF16", "_FP8"):
        if grid.endswith(suffix):
            return grid[: -len(suffix)]
    return grid


def pairs(runs: list[GridRun]) -> list[tuple[GridRun, GridRun]]:
    """Each low-precision row with its grid's (or sibling grid's) BF16 row of the same
    degrees and devices (the one on the same stack where there are several); the speed-up is
    per token, so the two may differ in batch."""
    out = []
    for run in runs:
        if run.skip or run.precision not in LOW:
            continue
        twins = [
            r
            for r in runs
            if not r.skip
            and _workload(r.grid) == _workload(run.grid)
            and r.precision in ("bf16", "fp16")
            and _degrees(r) == _degrees(run)
        ]
        if twins:
            same = [r for r in twins if r.stack == run.stack]
            out.append((run, (same or twins)[-1]))
    return out


def ratio_rows(found: dict[str, Priced], paired) -> list[tuple[str, float, float]]:
    """(label, measured speed-up, predicted speed-up) per pair priced on both sides."""
    rows = []
    for low, bf16 in paired:
        a, b = found[low.id], found[bf16.id]
        if None in (a.predicted_s, b.predicted_s) or not (a.measured_s and b.measured_s):
            continue
        measured = b.per_token(b.measured_s) / a.per_token(a.measured_s)
        predicted = b.per_token(b.predicted_s) / a.per_token(a.predicted_s)
        rows.append((f"{low.id} / {bf16.id.split('#')[1]} ({low.precision})", measured, predicted))
    return rows


def report(runs: list[GridRun]) -> list[str]:
    paired = pairs(runs)
    wanted = {r.id for r in runs if r.precision in LOW} | {b.id for _, b in paired}
    priced = price([r for r in runs if r.id in wanted])
    found = {p.id: p for p in priced}
    lines = [f"{'FP8 row / BF16 twin':<58} {'meas x':>7} {'pred x':>7} {'err':>7}"]
    ratio_errors = []
    for label, measured, predicted in ratio_rows(found, paired):
        err = predicted / measured - 1
        ratio_errors.append(abs(err))
        lines.append(f"{label:<58} {measured:7.3f} {predicted:7.3f} {err:+7.1%}")
    lines += ["", f"{'FP8 row':<40} {'stack':<18} {'meas s':>8} {'pred s':>8} {'err':>7} "
              f"{'mem GiB meas/pred':>18}"]  # fmt: skip
    step_errors, skipped, memory = [], [], []
    for p in priced:
        run = next(r for r in runs if r.id == p.id)
        if run.precision not in LOW:
            continue
        if p.skipped:
            skipped.append(f"  {p.id}: {p.skipped}")
            continue
        if p.error is None:
            continue
        step_errors.append(abs(p.error))
        mem = "-"
        if p.memory_error is not None:
            memory.append((p.memory_error, p.id))
            mem = f"{p.measured_memory / GiB:.1f}/{p.predicted_memory / GiB:.1f}"
        lines.append(
            f"{p.id:<40} {p.stack:<18} {p.measured_s:8.3f} {p.predicted_s:8.3f} {p.error:+7.1%} "
            f"{mem:>18}"
        )
    if skipped:
        lines += ["", "not priced:", *skipped]
    worst = max(ratio_errors, default=float("nan"))
    within = sum(e <= TARGET_RATIO for e in ratio_errors)
    lines += [
        "",
        f"FP8/BF16 speed-up: {len(ratio_errors)} pairs, {within} within {TARGET_RATIO:.0%} of "
        f"the measured ratio, worst {worst:.1%} (target: every pair)",
        f"FP8 step time: {len(step_errors)} rows, median |error| "
        f"{statistics.median(step_errors) if step_errors else float('nan'):.1%} "
        f"(target <= {TARGET_MEDIAN:.0%})",
        # no target of issue 18's; issue 17's for BF16 peaks is 10%
        f"FP8 peak memory: {len(memory)} rows with a measured peak, median |error| "
        f"{statistics.median(abs(e) for e, _ in memory) if memory else float('nan'):.1%}; "
        f"predicted more than {TARGET_MEMORY:.0%} under the measured peak: "
        + (", ".join(f"{i} {e:+.0%}" for e, i in memory if e < -TARGET_MEMORY) or "none"),
    ]
    return lines


def fit(runs: list[GridRun], recipe: str) -> list[str]:
    """The recipe's gemm_efficiency minimising the mean |log(predicted / measured speed-up)|
    over its pairs."""
    paired = [(a, b) for a, b in pairs(runs) if a.precision == recipe]
    wanted = {a.id for a, _ in paired} | {b.id for _, b in paired}
    subset = [r for r in runs if r.id in wanted]
    original = precisions.RECIPES[recipe]
    scored = []
    try:
        for k in range(60, 121, 5):
            precisions.RECIPES[recipe] = replace(original, gemm_efficiency=k / 100)
            found = {p.id: p for p in price(subset)}
            rows = ratio_rows(found, paired)
            loss = statistics.fmean(abs(math.log(p / m)) for _, m, p in rows)
            scored.append((loss, k / 100, rows))
    finally:
        precisions.RECIPES[recipe] = original
    loss, best, rows = min(scored)
    lines = [f"fit of {recipe} over {len(rows)} pairs: gemm_efficiency {best}: mean |log "
             f"ratio error| {loss:.3f}"]  # fmt: skip
    lines += [f"  {label}: measured {m:.3f}, predicted {p:.3f}" for label, m, p in rows]
    lines += [f"  gemm_efficiency {k}: {x:.3f}" for x, k, _ in scored]
    return lines


def auto_choice() -> list[str]:
    """Llama 3.1 70B with precision="auto" on 8 DGX H100 and 8 DGX A100 nodes."""
    import autopar
    from autopar.cli.models import load_model

    loaded = load_model("llama3-70b")
    graph = autopar.trace(loaded.model, loaded.inputs)
    lines = []
    for profile in ("dgx_h100", "dgx_a100_80g"):
        cluster = autopar.Cluster.from_profile(profile, num_nodes=8)
        plan = autopar.parallelize(loaded.model, cluster, precision="auto", graph=graph)
        said = next(n for n in plan.notes if n.startswith("precision auto:"))
        lines += [
            f"{profile} x 8: {plan.precision}, {plan.config.as_text()}, step "
            f"{plan.step_time_s:.3f} s, MFU {plan.mfu:.1%}",
            f"  {said}",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="", help="only grids whose id starts with this")
    parser.add_argument("--fit", metavar="RECIPE", choices=LOW, help="fit RECIPE's GEMM efficiency")
    parser.add_argument("--auto", action="store_true", help="Llama 3.1 70B with precision auto")
    args = parser.parse_args(argv)
    if args.auto:
        print("\n".join(auto_choice()))
        return 0
    runs = [r for r in read_grids() if r.grid.startswith(args.grid)]
    print("\n".join(fit(runs, args.fit) if args.fit else report(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
