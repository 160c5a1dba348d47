"""The plan: what `evaluate` and `parallelize` return, as plain data, and how it reads.

    types.py   `Plan`, `StagePlan`, `ModelSource`: frozen data (seconds and bytes), JSON that
               loads without executing code (`Plan.from_json`, `Plan.write_json`)
    check.py   `plan_problems`: a plan.json's types, ranges and invariants, checked on load
    files.py   atomic writes and the directory lock that keep plan.json and train.py a pair
    build.py   `plan_from_estimate` and the parts parallelize adds: an `Estimate` of the cost
               model and the search's results -> a Plan
    text.py    `summary_text`, `explain_text`: the plan as it prints (`plan.summary()`,
               `plan.explain()`, the CLI)
    plots.py   the plan's pictures (pipeline Gantt, memory per stage, breakdown); matplotlib

The Plan type imports no phase after it: `plan.save()` and `plan.plot()` are shortcuts to the
driver (`autopar.api.save`, `autopar.api.plot`), which calls codegen and the plots.
"""

from __future__ import annotations

from autopar.plan.types import SCHEMA_VERSION, ModelSource, Plan, PlanError, StagePlan

__all__ = ["SCHEMA_VERSION", "ModelSource", "Plan", "PlanError", "StagePlan"]
