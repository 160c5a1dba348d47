"""`autopar plan` and `autopar explain`: plan a model on a cluster, and read a saved plan.

In: parsed arguments (`autopar.cli`). Out: the text to print (the plan's summary, or its JSON
with ``--json``), plan.json written into the output directory and, with ``--plots``, the
plan's pictures. A progress bar on stderr follows the search's degree choices.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from autopar.config.precision import PRECISIONS as _KNOWN
from autopar.errors import AutoparError

# "auto": the planner picks BF16 or a low-precision recipe the device runs (`parallelize`)
PRECISIONS = (*_KNOWN, "auto")


def cluster_from_args(
    profile: str,
    nodes: int | None,
    devices: int | None,
    sites: int = 1,
    link_gbps: float | None = None,
    latency_ms: float = 10.0,
):  # -> Cluster
    """`Cluster.from_profile` from --profile, --nodes and --devices (total devices), over
    --sites joined by --site-link-gbps."""
    from autopar.hardware import Cluster

    if nodes is not None and devices is not None:
        raise AutoparError("give --nodes or --devices, not both")
    if devices is not None:
        cluster = Cluster.from_profile(profile, num_devices=devices)
    else:
        cluster = Cluster.from_profile(profile, num_nodes=1 if nodes is None else nodes)
    if sites == 1 and link_gbps is None:
        return cluster
    return cluster.over_sites(sites, link_gbps, latency_ms / 1e3)


class ProgressBar:
    """``searching [#####.....] 12/34 degree choices`` on a terminal; silent otherwise."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr  # the one in use now
        self.width = width
        self.live = self.stream.isatty()

    def __call__(self, index: int, total: int) -> None:
        if not self.live or total <= 0:
            return
        filled = self.width * index // total
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if index >= total else ""
        self.stream.write(f"\rsearching [{bar}] {index}/{total} degree choices{end}")
        self.stream.flush()


def run_plan(args: argparse.Namespace) -> str:
    from dataclasses import replace

    from autopar.api import PlanOptions, parallelize
    from autopar.cli.models import load_model
    from autopar.estimate.algorithms import AlgorithmOptions
    from autopar.estimate.stacks import DEFAULT_STACK, load_stack

    cluster = cluster_from_args(
        args.profile, args.nodes, args.devices, args.sites, args.site_link_gbps,
        args.site_latency_ms,
    )  # fmt: skip
    try:
        algorithms = AlgorithmOptions(
            choose=args.algorithm,
            token_budget=args.token_budget,
            diloco_token_overhead=args.diloco_token_overhead,
        )
    except ValueError as e:
        raise AutoparError(f"--algorithm, --token-budget, --diloco-token-overhead: {e}") from None
    loaded = load_model(args.model, args.seq_len)
    try:
        options = PlanOptions(
            progress=ProgressBar(), time_limit_s=args.time_limit, algorithms=algorithms
        )
    except ValueError as e:
        raise AutoparError(f"--time-limit: {e}") from None
    stack = args.stack
    if args.moe_imbalance is not None:  # the stack's options with the load measured or assumed
        cost = load_stack(stack or DEFAULT_STACK).options
        try:
            cost = replace(cost, moe_imbalance=args.moe_imbalance)
        except ValueError as e:
            raise AutoparError(f"--moe-imbalance: {e}") from None
        options, stack = replace(options, cost=cost), None
    plan = parallelize(
        loaded.model,
        cluster,
        loaded.inputs,
        global_batch_size=args.batch,
        precision=args.precision,
        options=options,
        model_factory=loaded.factory,
        stack=stack,
        loss_fn=args.loss,
    )
    path = plan.save(Path(args.out), program=False)
    written = [str(path)]
    if args.plots:
        from autopar.plan.plots import plot_all

        written += [str(p) for p in plot_all(plan, args.plots)]
    if args.json:
        return plan.to_json()
    return plan.summary() + "\n\nwrote " + ", ".join(written)


def load_plan(path: str):  # -> Plan
    from autopar.plan import Plan

    file = Path(path)
    if not file.is_file():
        raise AutoparError(f"{path}: no such plan file (write one with `autopar plan`)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise AutoparError(f"{path}: not a plan.json (its bytes are not UTF-8 text)") from None
    try:
        return Plan.from_json(text)
    except AutoparError as e:
        raise AutoparError(f"{path}: {e}") from None


def run_explain(args: argparse.Namespace) -> str:
    plan = load_plan(args.plan)
    text = plan.explain()
    if args.summary:
        text = plan.summary() + "\n\n" + text
    if args.plots:
        from autopar.plan.plots import plot_all

        text += "\n\nwrote " + ", ".join(str(p) for p in plot_all(plan, args.plots))
    return text
