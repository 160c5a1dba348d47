"""How benchmarks/published_grids_mapping.py reads data/published_grids.csv: every row is
priced but those of a stack autopar does not model, and the rows that state less are read as
their sources' defaults."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from published_grids_mapping import read_grids  # noqa: E402

RUNS = read_grids()


def test_only_rows_of_a_stack_autopar_does_not_model_are_skipped():
    skipped = {r.id: r.skip for r in RUNS if r.skip}
    assert skipped, "MaxText's rows run JAX"
    assert all("JAX" in why for why in skipped.values()), skipped
    assert all(r.profile for r in RUNS if not r.skip), [r.id for r in RUNS if not r.profile]


def test_deepspeeds_bert_rows_are_read_as_the_glue_example_ran_them():
    """The source's README: run_glue.py on bert-large in fp32 (the csv says fp16); run_glue's
    default sequence length; the step from the autotuner's samples per second."""
    bert = [r for r in RUNS if r.grid == "DSAT_bert-large_16xV100"]
    assert len(bert) == 4
    assert {(r.family, r.precision, r.dims.seq_len, r.profile) for r in bert} == {
        ("bert", "fp32", 128, "dgx2_v100")
    }
    first = bert[0]
    assert first.global_batch == 1488
    assert abs(first.measured_step_s - 1488 / 835.244) < 1e-6
    assert bert[3].measured_step_s is None and not bert[3].ran  # the source's 0: no run
