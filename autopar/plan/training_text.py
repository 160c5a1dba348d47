"""The lines summary() and explain() print about the training algorithm (`Plan.training`).

In: the plan's `training` record (`autopar.plan.training`). Out: for summary() one line per
algorithm priced -- its config, step time, cross-site bytes, goodput and time to the token
budget -- the chosen one marked; for explain() why it was chosen and under what assumption.
"""

from __future__ import annotations

from typing import Any

NAMES = {"sync": "synchronous", "ft": "fault-tolerant groups", "diloco": "DiLoCo"}


def _label(c: dict[str, Any]) -> str:
    if c["name"] == "diloco":
        how = "streaming" if c["fragments"] > 1 else "blocking"
        return f"DiLoCo x{c['replicas']} H={c['inner_steps']} {how}"
    if c["name"] == "ft":
        return f"ft groups x{c['replicas']}"
    return "synchronous"


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f} d" if seconds >= 86400 else f"{seconds / 3600:.1f} h"


def training_lines(training: dict[str, Any]) -> list[str]:
    """summary(): the algorithms priced, fastest to the token budget first."""
    if not training:
        return []
    budget = training["token_budget"]
    chosen = training["chosen"]
    if len(training["candidates"]) == 1:  # synchronous, nothing else applies
        return [
            f"  training    {NAMES[chosen['name']]}: {budget / 1e12:.3g} T tokens in "
            f"{_days(chosen['time_to_budget_s'])}"
        ]
    lines = [
        f"  training    {NAMES[training['chosen']['name']]}: time to {budget / 1e12:.3g} T "
        f"tokens, per algorithm (step, cross-site GB a step, goodput):"
    ]
    for c in training["candidates"]:
        mark = "*" if _same(c, chosen) else " "
        lines.append(
            f"   {mark} {_label(c):<28} {_days(c['time_to_budget_s']):>9}  "
            f"{c['step_time_s']:.3f} s  {c['cross_site_bytes_per_step'] / 1e9:,.1f} GB  "
            f"{c['goodput']:.1%}  [{c['config']}]"
        )
    return lines


def training_explanation(training: dict[str, Any]) -> str:
    """explain(): why the algorithm, against the synchronous one, and the assumption."""
    if not training:
        return "Training algorithm: not priced (evaluate prices the synchronous one only)"
    chosen = training["chosen"]
    sync = next(c for c in training["candidates"] if c["name"] == "sync")
    where = (
        f"{training['sites']} sites joined by {training['site_link_gbps']:g} Gb/s"
        if training["sites"] > 1
        else "one site"
    )
    text = (
        f"Training algorithm: {_label(chosen)} on {where} reaches "
        f"{training['token_budget'] / 1e12:.3g} T tokens in {_days(chosen['time_to_budget_s'])}"
    )
    if chosen["name"] != "sync":
        text += (
            f", against {_days(sync['time_to_budget_s'])} synchronous "
            f"({sync['step_time_s']:.2f} s a step, "
            f"{sync['cross_site_bytes_per_step'] / 1e9:,.1f} GB across sites a step vs "
            f"{chosen['cross_site_bytes_per_step'] / 1e9:,.1f})"
        )
    detail = chosen["detail"]
    text += f". {detail[:1].upper()}{detail[1:]}."
    if any(c["name"] == "diloco" for c in training["candidates"]):
        text += f" Convergence: {training['assumption']}."
    return text


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("name", "replicas", "inner_steps", "fragments", "config")
    return all(a[k] == b[k] for k in keys)
