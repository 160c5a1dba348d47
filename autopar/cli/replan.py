"""`autopar replan plan.json --nodes N [--devices N] [--config k=v,...] -o DIR`.

In: parsed arguments (`autopar.cli.main`). Out: the new plan's summary (or its JSON with
``--json``); the new plan.json and its train.py written into DIR (`autopar.api.replan`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autopar.api import replan
from autopar.cli.plan import load_plan
from autopar.config import parse_config


def run_replan(args: argparse.Namespace) -> str:
    """The new plan.json and its train.py in DIR; prints the new plan's summary."""
    plan = load_plan(args.plan)
    config = parse_config(args.config) if args.config else None
    new = replan(
        plan,
        num_nodes=args.num_nodes,
        num_devices=args.num_devices,
        config=config,
        profile=args.profile,
        trust_factory=args.trust_factory,
    )
    path = new.save(Path(args.out))
    written = [str(path)] + ([str(path.parent / "train.py")] if new.model_source else [])
    if args.json:
        return new.to_json()
    return new.summary() + "\n\nwrote " + ", ".join(written)
