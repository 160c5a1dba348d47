"""autopar: a compiler-style auto-parallelism planner for PyTorch training.

The public API (docs/architecture.md draws the phases behind it):

    autopar.Cluster.from_profile(name_or_path, num_nodes=1, *, sites=1, site_link_gbps=None)
    autopar.ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, cp=1, ep=1, zero_stage=0, ...)
    autopar.load_profile(name_or_path), autopar.shipped_profile_names()
    autopar.load_stack(name_or_path), autopar.stack_names()   (software stacks a plan is priced for)
    autopar.trace(model, example_inputs) -> ModelGraph       (imports torch on first use)
    autopar.evaluate(model, cluster, config, example_inputs, *, global_batch_size) -> Plan
    autopar.evaluate_stages(model, cluster, [StageMesh, ...], example_inputs, *,
                            global_batch_size, micro_batch_size) -> Estimate
                          (stages of their own tp and dp, cut inside layers: priced, not run)
    autopar.parallelize(model, cluster, example_inputs=None, *, global_batch_size=None) -> Plan
    autopar.PlanOptions(..., algorithms=autopar.AlgorithmOptions(token_budget=...))
                          (synchronous, fault-tolerant groups or DiLoCo, priced and chosen)
    autopar.replan(plan, *, num_nodes=None, num_devices=None) -> Plan   (same model, new size)
    autopar.export(plan, "torchtitan"|"megatron"|"deepspeed"|"accelerate", directory=None)
    plan.summary(), plan.explain(), plan.save(dir), plan.plot(kind, path), Plan.from_json(text)
    autopar.models.zoo / autopar.models.hf                     (built-in and Hugging Face models)

Importing autopar does not import torch: profiles, clusters and the cost model work without it;
the torch-based parts load on first access. Modules of earlier versions that moved (for example
`autopar.cluster`, now `autopar.hardware.cluster`) still import, with a DeprecationWarning
naming the new path (`_MOVED`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

from autopar.config import ParallelConfig
from autopar.errors import AutoparError, ConfigError, ProfileError
from autopar.hardware import Cluster, HardwareProfile, load_profile, shipped_profile_names

__version__ = "0.1.0"

# The tracer's package is `autopar.tracing` so that the name `autopar.trace` stays the function.
_LAZY = {
    "trace": "autopar.tracing",
    "ModelGraph": "autopar.tracing",
    "TraceError": "autopar.tracing",
    "evaluate": "autopar.api",
    "evaluate_stages": "autopar.api",
    "parallelize": "autopar.api",
    "replan": "autopar.api",
    "export": "autopar.api",
    "PlanOptions": "autopar.solve",
    "AlgorithmOptions": "autopar.estimate.algorithms",
    "InfeasibleError": "autopar.solve",
    "Plan": "autopar.plan",
    "CostOptions": "autopar.estimate",
    "load_stack": "autopar.estimate",
    "stack_names": "autopar.estimate",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "models":
        return importlib.import_module("autopar.models")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


# Modules of autopar 0.1 that moved when the tree took the phases' shape: old name -> the
# modules that now hold its names, and the names that changed ("old": "module:new").
_MOVED: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "autopar.cluster": (("autopar.hardware.cluster",), {}),
    "autopar.plan_text": (("autopar.plan.text",), {}),
    "autopar.plots": (("autopar.plan.plots",), {}),
    "autopar.layout": (("autopar.estimate.layout",), {}),
    "autopar.whatif": (("autopar.solve.whatif",), {}),
    "autopar.elastic": (("autopar.api", "autopar.plan.rebuild", "autopar.cli.replan"), {}),
    "autopar.demo": (("autopar.cli.demo",), {}),
    "autopar.commands": (("autopar.cli",), {}),
    "autopar.commands.plan_verb": (("autopar.cli.plan",), {}),
    "autopar.commands.compare": (("autopar.cli.compare", "autopar.config.text"), {}),
    "autopar.commands.generate": (("autopar.cli.generate",), {}),
    "autopar.commands.config_text": (("autopar.config.text",), {}),
    "autopar.commands.models": (
        ("autopar.cli.models",),
        {"build_hf_config": "autopar.models.hf:build_from_config"},
    ),
}


class _MovedModule(types.ModuleType):
    """Stands for a moved module: each attribute is looked up where it lives now."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # introspection (inspect, pickle) asks for dunders: none here
            raise AttributeError(name)
        targets, renamed = _MOVED[self.__name__]
        if name in renamed:
            module, _, attr = renamed[name].partition(":")
            return getattr(importlib.import_module(module), attr)
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(
            f"{self.__name__} moved to {' and '.join(targets)}, which have no attribute {name!r}"
        )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name (`_MOVED`) as a `_MovedModule`, warning with the new path.
    Consulted after the regular finders, so it never shadows a module that exists."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's API)
        if fullname not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001
        module = _MovedModule(spec.name)
        module.__path__ = []  # a package, so that old submodule names import too
        return module

    def exec_module(self, module):  # noqa: ANN001
        targets = " and ".join(_MOVED[module.__name__][0])
        warnings.warn(
            f"{module.__name__} moved to {targets}: import from there (autopar 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())

__all__ = [
    "AutoparError",
    "Cluster",
    "ConfigError",
    "CostOptions",
    "ModelGraph",
    "HardwareProfile",
    "InfeasibleError",
    "ParallelConfig",
    "Plan",
    "PlanOptions",
    "ProfileError",
    "TraceError",
    "evaluate",
    "parallelize",
    "replan",
    "export",
    "load_profile",
    "load_stack",
    "shipped_profile_names",
    "stack_names",
    "trace",
]
