"""Code generation: a Plan -> a readable `train.py` that runs the plan under torchrun.

In: a `Plan` that records its model factory (`plan.model_source`). Out: `<dir>/train.py`, a
Python program that imports `autopar.runtime`, reads `plan.json` beside it and trains the
model with the plan. The decisions are spelt out as code and comments: the mesh and its rank
layout, the tensor-parallel plan per module with the collectives each style implies and the
ones the intra-layer ILP planned, the data-parallel wrapping, the pipeline schedule, the
recompute policy, the launch commands (one node, several nodes).

Invariant: generation is deterministic (same plan -> same bytes) and leaves nothing
half-written (written to a temporary name, then renamed).

Public functions:
    generate(plan, directory, trust_factory=False) -> Path of train.py
    program_text(plan, trust_factory=False) -> str
"""

from __future__ import annotations

from pathlib import Path

from autopar.codegen.program import program_text
from autopar.plan.files import ensure_directory, write_atomic

__all__ = ["generate", "program_text"]


def generate(plan: object, directory: str | Path, *, trust_factory: bool = False) -> Path:
    """Write ``train.py`` for ``plan`` into ``directory`` (created if needed); returns its path.

    Generation builds the model on the meta device from the plan's factory: a plan read from a
    file that names a factory other than autopar's own needs ``trust_factory=True``.

    Raises:
        ValueError: the plan records no model factory (pass `model_factory=` to
            `autopar.parallelize` / `autopar.evaluate`).
        UntrustedFactoryError: the factory is the file's, without the user's consent.
    """
    text = program_text(plan, trust_factory=trust_factory)  # type: ignore[arg-type]
    return write_atomic(ensure_directory(directory) / "train.py", text)
