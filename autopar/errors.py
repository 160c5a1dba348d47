"""Errors autopar raises for bad input. Each message names the field and the numbers."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of autopar's own errors."""


class ProfileError(AutoparError, ValueError):
    """A hardware profile is missing, malformed, or asks for a cluster it cannot form."""


class ConfigError(AutoparError, ValueError):
    """A ParallelConfig does not fit the cluster or is inconsistent in itself."""
