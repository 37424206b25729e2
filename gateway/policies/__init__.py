"""Routing policies, one per module, behind the ``Policy`` protocol."""

from __future__ import annotations

from gateway.config import RoutingSection
from gateway.policies.least_loaded import LeastLoaded
from gateway.policies.prefix import PrefixAware
from gateway.policies.round_robin import RoundRobin
from gateway.types import Policy


def make_policy(settings: RoutingSection) -> Policy:
    """The one factory from a canonical config name to a policy."""
    if settings.policy == "least_loaded":
        return LeastLoaded()
    if settings.policy == "round_robin":
        return RoundRobin()
    if settings.policy == "prefix":
        return PrefixAware(settings.prefix_chars, settings.bounded_load_factor)
    raise ValueError(f"unknown policy {settings.policy!r}")


__all__ = ["LeastLoaded", "PrefixAware", "RoundRobin", "make_policy"]
