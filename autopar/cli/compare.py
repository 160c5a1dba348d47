"""`autopar compare plan.json --config tp=8,pp=4,...`: a saved plan beside a config the user
gives, priced by `evaluate` on the same model, cluster, batch, precision and cost options.

In: the plan file and a ``key=value`` list (ParallelConfig fields, with the short names the
config text prints: zero, mbs, v, sp, order), or a config's text as the tool prints it
(`autopar.config.text.parse_config` reads both). Out: a table, plan and user config
side by side, every breakdown term and the change; ``--json`` gives both plans' JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autopar.config.text import parse_config

__all__ = ["compare_text", "run_compare"]

GiB = 2**30


def run_compare(args: argparse.Namespace) -> str:
    from autopar.api import PlanOptions, evaluate
    from autopar.cli.models import model_from_plan
    from autopar.cli.plan import load_plan
    from autopar.hardware import Cluster

    plan = load_plan(args.plan)
    config = parse_config(args.config)
    cluster = Cluster.from_profile(
        args.profile or plan.cluster,
        plan.num_nodes,
        devices_per_node=plan.world_size // plan.num_nodes,
    )
    loaded = model_from_plan(plan, args.trust_factory)
    config.validate(cluster)
    yours = evaluate(
        loaded.model,
        cluster,
        config,
        loaded.inputs,
        global_batch_size=plan.global_batch_size,
        precision=plan.precision,
        optimizer=plan.optimizer,
        options=PlanOptions().cost,  # the options parallelize priced the plan with
        model_factory=loaded.factory,
    )
    if args.json:
        both = {"plan": json.loads(plan.to_json()), "yours": json.loads(yours.to_json())}
        return json.dumps(both, indent=1, sort_keys=True)
    return compare_text(plan, yours)


def compare_text(plan: Any, yours: Any) -> str:
    """Two plans side by side: headline figures, then every breakdown term."""
    rows: list[tuple[str, str, str, str]] = [
        ("step time", f"{plan.step_time_s:.3f} s", f"{yours.step_time_s:.3f} s",
         f"{yours.step_time_s / plan.step_time_s - 1:+.1%}"),
        ("MFU", f"{plan.mfu:.1%}", f"{yours.mfu:.1%}", f"{(yours.mfu - plan.mfu) * 100:+.1f} pt"),
        ("tokens/s", f"{plan.tokens_per_s:,.0f}", f"{yours.tokens_per_s:,.0f}",
         f"{yours.tokens_per_s / plan.tokens_per_s - 1:+.1%}"),
        ("peak memory", f"{plan.peak_memory_bytes / GiB:.1f} GiB",
         f"{yours.peak_memory_bytes / GiB:.1f} GiB" + ("" if yours.fits else " DOES NOT FIT"),
         f"{(yours.peak_memory_bytes - plan.peak_memory_bytes) / GiB:+.1f} GiB"),
        ("micro-batches", str(plan.num_microbatches), str(yours.num_microbatches), ""),
    ]  # fmt: skip
    from autopar.plan.text import ordered_terms

    terms = [k for k, v in ordered_terms(plan.breakdown) if v > 0 or yours.breakdown.get(k, 0) > 0]
    for k in terms:
        a, b = plan.breakdown.get(k, 0.0), yours.breakdown.get(k, 0.0)
        rows.append((f"  {k}", f"{a:.4f} s", f"{b:.4f} s", f"{b - a:+.4f} s"))
    lines = [
        f"{plan.model} on {plan.cluster} x {plan.num_nodes} ({plan.world_size} devices), "
        f"batch {plan.global_batch_size}, {plan.precision}",
        f"  plan:  {plan.config.as_text()}",
        f"  yours: {yours.config.as_text()}",
        "",
        f"  {'':<20} {'plan':>16} {'yours':>26} {'change':>12}",
    ]
    lines += [f"  {n:<20} {a:>16} {b:>26} {d:>12}" for n, a, b, d in rows]
    faster = "plan" if plan.step_time_s <= yours.step_time_s else "your config"
    lines += ["", f"  faster: {faster}"]
    return "\n".join(lines)
