"""benchmarks/runtime_overhead.py compares like with like: its hand-written torch program and
autopar's generated program of the same plan compute the same losses.

PP2 x TP2 on 4 gloo ranks (one spawn), the tiny Llama, 2 steps: every rank runs the
hand-written program (`handwritten_programs.run`), then imports the generated train.py and
runs its main(); the per-step losses rank 0 prints must agree within the benchmark's own
tolerance (relative 1e-5). The timing itself is the benchmark's, never asserted here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "autopar" / "runtime"))

import handwritten_programs  # noqa: E402
import runtime_overhead as bench  # noqa: E402
from harness import run_ranks  # noqa: E402

SHAPE = handwritten_programs.Shape(tp=2, pp=2)
TINY: dict = {}  # llama-tiny as the zoo builds it: 2 layers, one per stage
STEPS, BATCH = 2, 8


def _both(program: str) -> tuple[list[float], list[float]]:
    """On every rank: the hand-written run, then the generated program's main(); the losses
    each printed on rank 0 (empty elsewhere)."""
    hand = [loss for loss, _ in handwritten_programs.run(SHAPE, STEPS, TINY, BATCH, bench.MBS)]
    spec = importlib.util.spec_from_file_location("generated_train", program)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [program, "--steps", str(STEPS), "--device", "cpu"]
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            spec.loader.exec_module(module)
            module.main()
    finally:
        sys.argv = argv
    generated = [float(loss) for _, loss, _ in bench.STEP_LINE.findall(buffer.getvalue())]
    return hand, generated


@pytest.mark.multiprocess
@pytest.mark.slow
def test_handwritten_and_generated_pp2_tp2_agree(tmp_path):
    program = bench.save_plan(SHAPE, tmp_path / "pp2xtp2", overrides=TINY, batch=BATCH)
    hand, generated = run_ranks(SHAPE.world_size, _both, str(program))[0]
    print(f"hand-written {hand}\ngenerated    {generated}")
    assert len(generated) == len(hand) == STEPS, (hand, generated)
    diff = bench.loss_difference(generated, hand)
    assert diff <= bench.LOSS_RTOL, f"losses differ by {diff:.1e} relative: {generated} {hand}"


def test_loss_difference_is_relative_and_refuses_short_runs():
    assert bench.loss_difference([2.0, 4.0], [2.0, 4.0]) == 0.0
    assert bench.loss_difference([2.0, 4.4], [2.0, 4.0]) == pytest.approx(0.1)
    assert bench.loss_difference([2.0], [2.0, 4.0]) == float("inf")
    assert bench.Row("x", 105.0, 100.0, 0.0).ratio == pytest.approx(1.05)
    assert not bench.Row("x", 1.0, 1.0, 1e-3).losses_match
