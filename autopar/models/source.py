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
    refuse_untrusted(factory, trusted)      a factory a plan file names runs only with consent
    refuse_untrusted_source(source, trusted)   ... and its loss and import root too
    build_from_source(factory, kwargs, device="meta", trusted=False) -> nn.Module
    FactoryError                            the factory raised (one line, its cause kept)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError

ZOO_FACTORY = "autopar.models.zoo:build"
HF_FACTORY = "autopar.models.hf:build"
# a Hugging Face config.json given by path (`autopar plan path/config.json`)
HF_CONFIG_FACTORY = "autopar.models.hf:build_from_config"
# autopar's own builders, which a plan file may name freely: they build a model from data
# (a preset name, overrides of its config, a config.json) and run no code of the file's choosing
# (the last is the name autopar 0.1 recorded for config.json plans)
BUILTIN_FACTORIES = frozenset(
    {ZOO_FACTORY, HF_FACTORY, HF_CONFIG_FACTORY, "autopar.commands.models:build_hf_config"}
)


class FactoryError(AutoparError, ValueError):
    """A model factory raised while building the model a plan names."""


class UntrustedFactoryError(AutoparError, ValueError):
    """A plan file names a model factory of its own, and the user has not consented to run it."""


def refuse_untrusted(factory: str, trusted: bool) -> None:
    """Raise `UntrustedFactoryError` for a factory that is neither autopar's own nor trusted.

    A plan is data: importing the ``module:function`` a plan.json names runs that module's
    code, so a crafted file could run anything. The user consents by passing
    ``trust_factory=True`` (command line: ``--trust-factory``), or by giving the model or its
    factory themselves (a plan made in this process from them is trusted).
    """
    if trusted or factory in BUILTIN_FACTORIES:
        return
    raise UntrustedFactoryError(
        f"the plan names the model factory {factory!r}, which is not one of autopar's own; "
        "autopar does not import or call code named in a plan file without your consent. If "
        "you made this plan or trust its source, pass trust_factory=True (command line: "
        "--trust-factory); or plan the model again from your own factory"
    )


def refuse_untrusted_source(source: Any, trusted: bool) -> None:
    """`refuse_untrusted` for everything of a plan's `model_source` that would make a program
    import code: the factory, and -- outside autopar's own -- the loss it names and the
    directory it puts on the import path (`import_root`: a ``transformers/`` there would run
    in place of the real one). Raises `UntrustedFactoryError` naming what and why."""
    refuse_untrusted(source.factory, trusted)
    if trusted:
        return
    loss = getattr(source, "loss", None)
    if loss and not loss.startswith("autopar."):
        raise UntrustedFactoryError(
            f"the plan names the loss {loss!r}, which a program would import; autopar does "
            "not import code named in a plan file without your consent: pass "
            "trust_factory=True (command line: --trust-factory) if you trust the plan, or give "
            "the loss on the program's command line (train.py --loss module:fn)"
        )
    root = getattr(source, "import_root", None)
    if root:
        raise UntrustedFactoryError(
            f"the plan puts {root!r} on the program's import path, where any module (a "
            "transformers/ directory) would run in place of the installed one; autopar does "
            "not do that for a plan file without your consent: pass trust_factory=True "
            "(command line: --trust-factory) if you trust the plan"
        )


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


def import_root(*paths: str | None) -> str | None:
    """The directory from which the first user module of the "module:function" ``paths``
    imports: its top-level package's parent (where "mypkg.models" lives in
    /home/me/proj/mypkg/models.py, /home/me/proj). None for autopar's own factories and for
    modules installed in site-packages, which import under torchrun as they are."""
    for path in paths:
        if not path or path.startswith("autopar."):
            continue
        module = path.partition(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.has_location:
            continue
        root = Path(spec.origin).resolve().parent
        for _ in range(module.count(".") + (spec.origin.endswith("__init__.py"))):
            root = root.parent
        if "site-packages" in root.parts or "dist-packages" in root.parts:
            continue
        return str(root)
    return None


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


def build_from_source(
    factory: str, kwargs: dict[str, Any], device: str = "meta", *, trusted: bool = False
) -> nn.Module:
    """Call ``factory(**kwargs)`` with its parameters on ``device`` (a factory that takes
    ``device`` is passed it; otherwise it runs under ``torch.device(device)``).

    Raises:
        UntrustedFactoryError: ``factory`` is not autopar's own and not ``trusted``
            (`refuse_untrusted`); nothing is imported.
        FactoryError: the factory raised (arguments it does not take, a plan file's kwargs of
            the wrong type): one line naming the factory and its arguments; the factory's own
            exception is its cause (`--traceback` shows it).
    """
    refuse_untrusted(factory, trusted)
    fn = resolve_callable(factory)
    kwargs = dict(kwargs)
    if "device" in inspect.signature(fn).parameters:
        kwargs["device"] = device
    try:
        with torch.device(device):
            model = fn(**kwargs)
    except AutoparError:
        raise
    except Exception as e:  # noqa: BLE001 -- a factory's or a plan file's fault: one line
        given = repr({k: v for k, v in kwargs.items() if k != "device"})
        given = given if len(given) <= 300 else given[:297] + "..."
        said = " ".join(str(e).split())
        raise FactoryError(f"{factory}(**{given}) failed: {type(e).__name__}: {said}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"{factory} returned {type(model).__name__}, not a torch.nn.Module")
    return model
