"""What the runtime can run, as bounds on the planner's search space.

In: the model and the `SpaceLimits` its trace and cluster gave. Out: the limits with the
parallelism the runtime cannot apply to this model taken out, and a note for each (the plan
carries them):

    pipeline stages     `autopar.runtime.parts` has no cut for the model's class -> pp = 1
    tensor parallelism  `tensor_parallel.splits_every_block` finds a block it would leave
                        replicated while the estimate prices it sharded -> tp = 1
    low precision       an FP8 recipe, for autopar's runtime: tp = 1 (torchao's Float8 TP
                        styles are not applied: `low_precision_limits`)

Invariant: the search offers no config the generated program would refuse or run otherwise
than priced, for these axes.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from autopar.config.precision import canonical, recipe_of, supported_recipes
from autopar.hardware.profile import HardwareProfile
from autopar.runtime.low_precision import runnable
from autopar.runtime.parts import has_parts
from autopar.runtime.tensor_parallel import splits_every_block
from autopar.solve.space import SpaceLimits


def runtime_limits(model: nn.Module, limits: SpaceLimits) -> tuple[SpaceLimits, list[str]]:
    """``limits`` bounded by what the runtime can do for ``model``, and why (module docstring)."""
    notes = []
    name = type(model).__name__
    if not has_parts(model):
        limits = replace(limits, max_pp=1)
        notes.append(
            f"no pipeline plans: autopar's runtime cannot cut {name} into stages "
            "(autopar.runtime.parts knows its zoo and Hugging Face decoder families)"
        )
    if not splits_every_block(model, limits.num_blocks):
        limits = replace(limits, max_tp=1)
        notes.append(
            f"no tensor-parallel plans: autopar's runtime would leave {name}'s blocks "
            "replicated (it splits nn.Linear projections it can pair column/row)"
        )
    return limits, notes


def low_precision_limits(
    limits: SpaceLimits, precision: str, stack: str
) -> tuple[SpaceLimits, list[str]]:
    """``limits`` for a plan in ``precision`` run by ``stack``: autopar's runtime (stack
    "autopar", or values of one's own) converts FP8 linears with torchao but applies no Float8
    tensor-parallel styles, so its FP8 plans keep tp = 1; other stacks are priced as they run."""
    if recipe_of(precision) is None or not _own_runtime(stack) or limits.max_tp == 1:
        return limits, []
    return replace(limits, max_tp=1), [
        f"no tensor-parallel plans in {canonical(precision)}: autopar's runtime converts the "
        "linears with torchao but does not apply its Float8 tensor-parallel styles yet"
    ]


def precision_candidates(profile: HardwareProfile, stack: str) -> tuple[list[str], str]:
    """What ``precision="auto"`` chooses among on ``profile`` for ``stack``: BF16 and every
    recipe the device has tensor cores for (for autopar's runtime, those torchao trains), and
    why there is nothing else where there is not."""
    peaks = profile.device.peak_flops_per_s
    recipes = supported_recipes(profile.kind, peaks)
    if _own_runtime(stack):
        recipes = [r for r in recipes if runnable(r)]
    names = ["bf16", *(r.name for r in recipes)]
    if recipes:
        return names, ""
    if profile.kind != "gpu":
        why = f"{profile.name} is a {profile.kind.upper()} profile: no FP8 training GEMMs"
    else:
        why = f"{profile.name} ({profile.device.name}) has no FP8 tensor cores"
    return names, why


def _own_runtime(stack: str) -> bool:
    """Whether ``stack`` is what autopar's generated programs run: its own, or values of
    one's own (`CostOptions.stack` "")."""
    return stack in ("autopar", "")
