"""How a plan names its model, and how that name becomes a model again.

In: a ``"module:function"`` factory path and its JSON keyword arguments (what
`autopar.plan.ModelSource` records), or a built model. Out: the factory, the model built on a
chosen device, and the model's fingerprint: 16 hex digits of SHA-256 over its parameter names
and shapes, equal for a model on the meta device and its real twin. The planner records it
(`autopar.plan.build`), the generated program and the checkpoints refuse another model by it
(`autopar.runtime`), and a re-plan checks the rebuilt model against it (`autopar.api.replan`).

Public names:
    ZOO_FACTORY, HF_FACTORY, HF_CONFIG_FACTORY   the factories of the built-in models
    resolve_callable("module:fn") -> the object
    model_fingerprint(model) -> str
    check_fingerprint(model, expected)      ValueError when they differ
    build_from_source(factory, kwargs, device="meta") -> nn.Module
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Any

import torch
from torch import nn

ZOO_FACTORY = "autopar.models.zoo:build"
HF_FACTORY = "autopar.models.hf:build"
# a Hugging Face config.json given by path (`autopar plan path/config.json`)
HF_CONFIG_FACTORY = "autopar.models.hf:build_from_config"


def resolve_callable(path: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute (ValueError names the path)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def model_fingerprint(model: nn.Module) -> str:
    """16 hex digits of SHA-256 over the parameter names and shapes (tied parameters once),
    the same for a model on the meta device and its real twin."""
    text = "\n".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_fingerprint(model: nn.Module, expected: str) -> None:
    """Raise ValueError when ``model`` is not the model the plan was made for."""
    got = model_fingerprint(model)
    if expected and got != expected:
        raise ValueError(
            f"the plan was made for a model with fingerprint {expected}, but the factory built "
            f"one with fingerprint {got} (other parameter names or shapes): re-plan this model"
        )


def build_from_source(factory: str, kwargs: dict[str, Any], device: str = "meta") -> nn.Module:
    """Call ``factory(**kwargs)`` with its parameters on ``device`` (a factory that takes
    ``device`` is passed it; otherwise it runs under ``torch.device(device)``)."""
    fn = resolve_callable(factory)
    kwargs = dict(kwargs)
    if "device" in inspect.signature(fn).parameters:
        kwargs["device"] = device
    with torch.device(device):
        return fn(**kwargs)
