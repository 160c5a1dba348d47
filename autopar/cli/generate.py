"""`autopar generate plan.json -o DIR`: write the runnable program of a saved plan;
`autopar export plan.json --to FRAMEWORK`: write it as another framework's configuration.

In: a plan.json (made by `autopar plan`, `parallelize`, `evaluate` or `replan`, with its model
factory recorded). Out: DIR/plan.json and DIR/train.py, the program `torchrun` runs; the
message names the launch command. Nothing is written when the plan cannot be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autopar.cli.plan import load_plan
from autopar.errors import AutoparError


def run_generate(args: argparse.Namespace) -> str:
    source = Path(args.plan)
    plan = load_plan(args.plan)
    if plan.model_source is None:
        raise AutoparError(
            f"{source} records no model factory, so no program can build its model: re-plan "
            "with model_factory='module:function' (or a zoo / Hugging Face preset)"
        )
    out = Path(args.out)
    plan.save(out, trust_factory=args.trust_factory)
    return (
        f"wrote {out / 'plan.json'} and {out / 'train.py'}; run it with\n"
        f"  torchrun --nproc-per-node={plan.world_size} {out / 'train.py'} --steps 10"
    )


def run_export(args: argparse.Namespace) -> str:
    from autopar.api import export

    source = Path(args.plan)
    plan = load_plan(args.plan)
    out = Path(args.out) if args.out else source.parent
    done = export(plan, args.to, out, price=not args.no_price, trust_factory=args.trust_factory)
    gaps = "".join(f"\n  - {gap}" for gap in done.gaps)
    said = f"; what {args.to} cannot express as planned:{gaps}" if gaps else ""
    return f"wrote {out / done.filename}{said}"
