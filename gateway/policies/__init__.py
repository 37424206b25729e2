"""Routing policies, one per module, behind the ``Policy`` protocol."""

from __future__ import annotations

from gateway.policies.least_loaded import LeastLoaded
from gateway.types import Policy


def make_policy(name: str) -> Policy:
    """The one factory from a canonical config name to a policy."""
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown policy {name!r}")


__all__ = ["LeastLoaded", "make_policy"]
