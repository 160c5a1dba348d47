"""What the runtime can run, as bounds on the planner's search space.

In: the model and the `SpaceLimits` its trace and cluster gave. Out: the limits with the
parallelism the runtime cannot apply to this model taken out, and a note for each (the plan
carries them):

    pipeline stages     `autopar.runtime.parts` has no cut for the model's class -> pp = 1
    tensor parallelism  `tensor_parallel.splits_every_block` finds a block it would leave
                        replicated while the estimate prices it sharded -> tp = 1

Invariant: the search offers no config the generated program would refuse or run otherwise
than priced, for these two axes.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

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
