"""benchmarks/published_grids.py's ranking: measured rows the noise cannot order are ties, a
grid of ties only is left out of Spearman (its pick still counts), an ordered grid is ranked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_grids as pg  # noqa: E402


def test_noise_ties_merge_rows_within_the_tolerance_of_a_runs_smallest():
    assert pg.noise_ties([1.0, 1.5, 1.01]) == pytest.approx([1.005, 1.5, 1.005])
    # no chaining: 1.03 is 3% from 1.00, so it starts a run of its own
    assert pg.noise_ties([1.0, 1.015, 1.03]) == pytest.approx([1.0075, 1.0075, 1.03])
    assert pg.noise_ties([1.0, 1.05, 1.10]) == [1.0, 1.05, 1.10]  # 5% apart: an order
    assert pg.noise_ties([2.0, 1.0], tolerance=1.0) == [1.5, 1.5]


def _rows(grid: str, measured: list[float], predicted: list[float]) -> list[pg.Priced]:
    return [
        pg.Priced(
            f"{grid}#{i}", grid, "s", "c", m, p, 1.0, 1.0, 2.0, tokens_per_step=1, num_devices=1
        )
        for i, (m, p) in enumerate(zip(measured, predicted, strict=True), 1)
    ]


def test_a_grid_within_the_noise_is_not_ranked_and_an_ordered_one_is():
    # measured 1% apart, predicted in the opposite order: no order to get wrong
    noise = _rows("NOISE", [10.0, 10.1, 10.2], [3.0, 2.0, 1.0])
    # measured 10% apart, predicted in the opposite order: Spearman -1
    wrong = _rows("WRONG", [10.0, 11.0, 12.1], [3.0, 2.0, 1.0])
    lines = pg.summary(noise + wrong)
    assert any("grid NOISE: 3 rows, all within 2% of the best" in line and "no Spearman" in line
               for line in lines)  # fmt: skip
    assert any("grid WRONG: 3 rows, Spearman -1.00, pick +21.0%" in line for line in lines)
    ranking = next(line for line in lines if line.startswith("ranking:"))
    assert "1 grids of >= 3 rows ordered beyond the noise, Spearman min -1.00" in ranking
    assert "1 grids all ties" in ranking and "pick worst +21.0% over 2 grids" in ranking


def test_the_step_line_names_the_worst_row_and_the_nemo_rows_median():
    rows = _rows("DGXC_X", [10.0, 10.0, 10.0], [10.5, 9.0, 10.1]) + _rows("OTHER", [1.0], [1.4])
    step = next(line for line in pg.summary(rows) if line.startswith("step time:"))
    assert "4 rows, median |error| 7.5%" in step
    assert "worst +40.0% OTHER#1 (<= 30%)" in step
    assert "NeMo H100 BF16: 3 rows, median 5.0% (<= 8%)" in step


def test_a_tie_is_ordered_as_predicted_and_never_costs_spearman():
    # 10.0 and 10.1 tie; 12.0 is beyond the noise
    tied = pg.noise_ties([10.1, 10.0, 12.0])
    assert pg.ranks_within_noise(tied, [1.0, 2.0, 3.0]) == [0.0, 1.0, 2.0]
    assert pg.spearman(
        [1.0, 2.0, 3.0], pg.ranks_within_noise(tied, [1.0, 2.0, 3.0])
    ) == pytest.approx(1.0)
    # the prediction's order of the row beyond the noise still counts
    wrong = [3.0, 2.0, 1.0]
    assert pg.spearman(wrong, pg.ranks_within_noise(tied, wrong)) == pytest.approx(-0.5)


def test_each_aceso_csv_is_one_of_its_plans_logged_runs():
    """data/aceso_stages.json `runs` (the artifact's full logs): the step the row's csv holds
    is one of the steps its plan's logs report, and where a stage's compute is in both, the
    same run's."""
    plans = pg.load_plans()
    repeated = 0
    for path, plan in plans.items():
        # Aceso's own prediction, every stage's (its search's info csv)
        assert all(s["aceso_predicted"]["step_s"] > 0 for s in plan["stages"]), path
        steps = [r["step_s"] for r in plan["runs"] if r["step_s"]]
        if not steps:
            continue
        csv_step = plan["stages"][0]["measured"]["step_s"]
        same = [
            i for i, s in enumerate(steps) if abs(s / csv_step - 1) < 0.02
        ]  # csv and log: 0-1.6%
        assert same, f"{path}: csv step {csv_step} is none of its runs' {steps}"
        repeated += len(steps) > 1
        run = [r for r in plan["runs"] if r["step_s"]][same[-1]]
        for stage, seconds in run["compute_s"].items():
            measured = plan["stages"][int(stage)].get("measured")
            if measured:
                busy = measured["forward_compute_s"] + measured["backward_compute_s"]
                assert seconds == pytest.approx(busy, rel=0.02), (path, stage)
    assert repeated == 6  # the six A10G plans the artifact ran twice


def test_a_row_the_source_ran_twice_is_also_priced_against_its_nearest_run():
    row = pg.Priced("G#1", "G", "s", "c", 28.24, 44.18, repeats=(43.55, 28.24))
    lines = pg.repeated([row])
    assert "runs 43.55 / 28.24 s (apart 54.2%)" in lines[2]
    assert "+56.4% against the row's run, +1.4% against the nearest" in lines[2]
    assert lines[-1].endswith("worst |error| 1.4%")
    assert pg.repeated([pg.Priced("H#1", "H", "s", "c", 1.0, 1.1)]) == []  # one run: nothing
