"""autopar: a compiler-style auto-parallelism planner for PyTorch training.

The public API (DESIGN.md) grows phase by phase; what exists now:

    autopar.Cluster.from_profile(name_or_path, num_nodes=1)
    autopar.ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, cp=1, ep=1, zero_stage=0, ...)
    autopar.load_profile(name_or_path), autopar.shipped_profile_names()

Importing autopar does not import torch: profiles, clusters and the cost model work without it.
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import AutoparError, ConfigError, ProfileError
from autopar.hardware import HardwareProfile, load_profile, shipped_profile_names

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "Cluster",
    "ConfigError",
    "HardwareProfile",
    "ParallelConfig",
    "ProfileError",
    "load_profile",
    "shipped_profile_names",
]
