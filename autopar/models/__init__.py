"""Models to plan: the built-in zoo and Hugging Face models built from configs written in code.

    from autopar.models import zoo, hf
    zoo.build("gpt-tiny"), zoo.names(), zoo.example_inputs(name, model), zoo.lm_loss
    hf.build("llama3-8b")            # meta device; needs `pip install autopar[hf]`

`zoo` needs only torch. `hf` is imported on first access, and it imports transformers only
inside its functions, so `import autopar.models` works without transformers installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from autopar.models import zoo

__all__ = ["hf", "zoo"]


def __getattr__(name: str) -> ModuleType:
    if name == "hf":
        return importlib.import_module("autopar.models.hf")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
