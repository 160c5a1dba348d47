"""Predicted vs measured step time of the published runs, as a PNG.

    python3 benchmarks/plot_published_runs.py docs/figures/published_runs.png
    python3 benchmarks/plot_published_runs.py out.png --rows kor22      # a subset, faster
    python3 benchmarks/plot_published_runs.py out.png --from-json runs.json  # no re-pricing

In: the rows `published_runs.py` evaluates (the same mapping, the same `evaluate_all`, so the
same numbers), or the ``--json`` file it wrote. Out: `autopar.plan.plots.plot_published_runs`.
`results(rows)` is the library entry the notebooks use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # published_runs imports its mapping

import published_runs  # noqa: E402
from published_runs_mapping import DEFAULT_CSV, MCORE_TP_COMM_OVERLAP, read_runs  # noqa: E402

from autopar.plan.plots import plot_published_runs  # noqa: E402


def results(rows: str = "", csv: Path = DEFAULT_CSV) -> list[Any]:
    """`published_runs.Result` for every csv row whose id contains ``rows`` (all: "")."""
    runs = [r for r in read_runs(csv) if rows in r.id]
    return published_runs.evaluate_all(runs, MCORE_TP_COMM_OVERLAP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("png", type=Path)
    parser.add_argument("--rows", default="", help="only rows whose id contains this")
    parser.add_argument("--from-json", type=Path, help="rows from published_runs.py --json")
    args = parser.parse_args(argv)
    if args.from_json:
        rows: list[Any] = json.loads(args.from_json.read_text())["rows"]
        rows = [r for r in rows if args.rows in r["id"]]
    else:
        rows = results(args.rows)
    print(f"wrote {plot_published_runs(rows, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
