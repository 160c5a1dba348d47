"""Hardware: what the plan runs on, as data the cost model prices.

    profile.py   a TOML file in hardware_profiles/ -> `HardwareProfile` (devices, links, the
                 runtime's measured host overheads), validated on load
    cluster.py   `Cluster`: a profile times a number of nodes (or a TPU slice): world size,
                 where each rank sits, and how a group of ranks lies on the topology

Imports nothing of autopar but `autopar.errors`; the cost model's types come from `cost_models`.
"""

from __future__ import annotations

from autopar.hardware.cluster import Cluster
from autopar.hardware.profile import (
    RUNTIME_STYLES,
    HardwareProfile,
    Reliability,
    load_profile,
    profile_from_text,
    shipped_profile_names,
)

__all__ = [
    "RUNTIME_STYLES",
    "Cluster",
    "HardwareProfile",
    "Reliability",
    "load_profile",
    "profile_from_text",
    "shipped_profile_names",
]
