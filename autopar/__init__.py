"""autopar: a compiler-style auto-parallelism planner for PyTorch training.

The public API (DESIGN.md) grows phase by phase; what exists now:

    autopar.Cluster.from_profile(name_or_path, num_nodes=1)
    autopar.ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, cp=1, ep=1, zero_stage=0, ...)
    autopar.load_profile(name_or_path), autopar.shipped_profile_names()
    autopar.trace(model, example_inputs) -> ModelGraph       (imports torch on first use)
    autopar.evaluate(model, cluster, config, example_inputs, *, global_batch_size) -> Plan
    autopar.parallelize(model, cluster, example_inputs=None, *, global_batch_size=None) -> Plan
    autopar.replan(plan, *, num_nodes=None, num_devices=None) -> Plan   (same model, new size)
    autopar.models.zoo / autopar.models.hf                     (built-in and Hugging Face models)

Importing autopar does not import torch: profiles, clusters and the cost model work without it;
the torch-based parts load on first access.
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import AutoparError, ConfigError, ProfileError
from autopar.hardware import HardwareProfile, load_profile, shipped_profile_names

__version__ = "0.1.0"

# The tracer's package is `autopar.tracing` so that the name `autopar.trace` stays the function.
_LAZY = {
    "trace": "autopar.tracing",
    "ModelGraph": "autopar.tracing",
    "TraceError": "autopar.tracing",
    "evaluate": "autopar.api",
    "parallelize": "autopar.api",
    "replan": "autopar.elastic",
    "PlanOptions": "autopar.api",
    "InfeasibleError": "autopar.solve.search",
    "Plan": "autopar.plan",
    "CostOptions": "autopar.estimate",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "models":
        import importlib

        return importlib.import_module("autopar.models")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


__all__ = [
    "AutoparError",
    "Cluster",
    "ConfigError",
    "CostOptions",
    "ModelGraph",
    "HardwareProfile",
    "ParallelConfig",
    "Plan",
    "ProfileError",
    "TraceError",
    "evaluate",
    "parallelize",
    "replan",
    "load_profile",
    "shipped_profile_names",
    "trace",
]
