"""Overhead of the generated program against a hand-written torch program of the same plan.

    python3 benchmarks/runtime_overhead.py [--cases dp2xtp2,pp2xtp2,dp2xpp2xtp2]
                                           [--steps 12] [--repeats 3] [--quick]

The model: a Llama (the zoo's llama-tiny widened: hidden 256, 4 layers, seq 128, vocab 1024),
fp32, global batch 8 in micro-batches of 2, on CPU ranks over gloo. The cases (plans):

    dp2xtp2       DP2 x TP2 on 4 ranks
    pp2xtp2       PP2 (1F1B, 4 micro-batches) x TP2 on 4 ranks
    dp2xpp2xtp2   DP2 x PP2 (1F1B, 2 micro-batches per data rank) x TP2 on 8 ranks

Per case the same model (same seed), data, steps and plan run twice under torchrun:

    generated     autopar.evaluate -> plan.save -> torchrun out/overhead/<case>/train.py
    hand-written  `handwritten_programs.run`: DeviceMesh, parallelize_module, PipelineStage +
                  Schedule1F1B, a manual flat all-reduce over dp, the global-norm clip, AdamW --
                  plain torch, nothing from autopar.runtime

Each run prints per-step wall times; a run's time is the median over its steps after the
warm-up (the first two, the first with --quick), and each program's the median over the
repeats, run alternately so that load on the shared machine hits both alike. Printed per case:
generated ms/step, hand-written ms/step, their ratio (target <= 1.05) and whether the losses
of every step agree (relative 1e-5, the printed 6 decimals): the check that both programs
compute the same thing, so the ratio compares like with like. --quick: 4 steps, 1 repeat (a
smoke run, not a timing).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from handwritten_programs import MODEL, Shape  # noqa: E402

OVERRIDES = {
    "hidden": 256,
    "num_layers": 4,
    "ffn_hidden": 688,
    "num_heads": 8,
    "num_kv_heads": 4,
    "seq_len": 128,
    "vocab_size": 1024,
}
MBS, BATCH = 2, 8
CASES = {
    "dp2xtp2": Shape(dp=2, tp=2),
    "pp2xtp2": Shape(tp=2, pp=2),
    "dp2xpp2xtp2": Shape(dp=2, tp=2, pp=2),
}
STEP_LINE = re.compile(r"^step (\d+)/\d+\s+loss (\S+) .*time (\S+) s", re.M)
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Row:
    """One case's result: median ms per step of each program, and whether the losses agree."""

    case: str
    generated_ms: float
    handwritten_ms: float
    loss_diff: float  # the largest relative difference of a step's loss

    @property
    def ratio(self) -> float:
        return self.generated_ms / self.handwritten_ms

    @property
    def losses_match(self) -> bool:
        return self.loss_diff <= LOSS_RTOL

    def as_text(self) -> str:
        return (
            f"{self.case:12} {self.generated_ms:10.1f} {self.handwritten_ms:13.1f} "
            f"{self.ratio:6.3f}  {'yes' if self.losses_match else 'NO'} "
            f"(max rel diff {self.loss_diff:.1e})"
        )


def save_plan(shape: Shape, out: Path, overrides: dict = OVERRIDES, batch: int = BATCH) -> Path:
    """Price ``shape`` with autopar.evaluate and save plan.json + train.py under ``out``.

    Raises:
        ValueError: the plan's pipeline stages are not the even split the hand-written
            program uses (the two would not run the same plan).
    """
    import autopar
    from autopar.models import zoo

    model = zoo.build(MODEL, device="meta", **overrides)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=shape.world_size)
    config = autopar.ParallelConfig(dp=shape.dp, tp=shape.tp, pp=shape.pp, micro_batch_size=MBS)
    inputs = zoo.example_inputs(MODEL, model)
    plan = autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=batch, precision="fp32"
    )
    n = model.config.num_layers
    for k, stage in enumerate(plan.stages):
        blocks = [x for x in stage.layers if x.startswith("layers.")]
        even = [f"layers.{i}" for i in range(k * n // shape.pp, (k + 1) * n // shape.pp)]
        if blocks != even:
            raise ValueError(f"plan stage {k} holds {blocks}, the hand-written program {even}")
    plan.save(out)
    return out / "train.py"


def _torchrun(
    shape: Shape, script: Path, steps: int, case: str | None
) -> list[tuple[float, float]]:
    """(loss, seconds) per step of one torchrun of ``script`` on the shape's ranks."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={shape.world_size}", str(script), "--steps", str(steps)]
    if case is not None:
        cmd += ["--handwritten", case]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{script} failed:\n{done.stderr[-3000:]}")
    return [(float(loss), float(t)) for _, loss, t in STEP_LINE.findall(done.stdout)]


def loss_difference(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' per-step losses (inf if lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def measure(case: str, steps: int, repeats: int, out: Path) -> Row:
    shape = CASES[case]
    scripts = {"generated": save_plan(shape, out / case), "hand-written": Path(__file__)}
    warmup = 1 if steps <= 4 else 2
    medians: dict[str, list[float]] = {name: [] for name in scripts}
    losses: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, script in scripts.items():
            steps_run = _torchrun(shape, script, steps, case if name == "hand-written" else None)
            if len(steps_run) != steps:
                raise RuntimeError(f"{case} {name}: printed {len(steps_run)} of {steps} steps")
            losses[name] = [loss for loss, _ in steps_run]
            medians[name].append(statistics.median(t for _, t in steps_run[warmup:]))
    gen, hand = (statistics.median(medians[k]) * 1e3 for k in ("generated", "hand-written"))
    return Row(case, gen, hand, loss_difference(losses["generated"], losses["hand-written"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 repeat: a smoke run")
    parser.add_argument("--handwritten", metavar="CASE", help="(under torchrun) run that case")
    parser.add_argument("--out", default=str(REPO / "out" / "overhead"))
    args = parser.parse_args()
    if args.handwritten:
        import handwritten_programs

        handwritten_programs.run(CASES[args.handwritten], args.steps, OVERRIDES, BATCH, MBS)
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    steps, repeats = (4, 1) if args.quick else (args.steps, args.repeats)
    print(f"{MODEL} {OVERRIDES}, fp32, batch {BATCH} (micro-batches of {MBS}), gloo on CPU;")
    print(f"{steps} steps x {repeats} repeats per program{' (--quick: not a timing)' * args.quick}")
    print(f"{'case':12} {'generated':>10} {'hand-written':>13} {'ratio':>6}  losses match")
    print(f"{'':12} {'ms/step':>10} {'ms/step':>13}")
    for case in cases:
        print(measure(case, steps, repeats, Path(args.out)).as_text(), flush=True)
    print("target: ratio <= 1.05")


if __name__ == "__main__":
    main()
