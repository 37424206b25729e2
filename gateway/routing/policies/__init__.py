"""Routing policies, one per module, behind the ``Policy`` protocol."""

from __future__ import annotations

from gateway.config import RoutingSection
from gateway.routing.policies.kv import KvAware
from gateway.routing.policies.least_loaded import LeastLoaded
from gateway.routing.policies.prefix import PrefixAware
from gateway.routing.policies.round_robin import RoundRobin
from gateway.types import Policy


def make_policy(settings: RoutingSection, name: str | None = None) -> Policy:
    """The one factory from a canonical config name to a policy (``routing.policy`` unless
    another name is given, e.g. ``routing.pin_policy``)."""
    name = name or settings.policy
    if name == "least_loaded":
        return LeastLoaded()
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix":
        return PrefixAware(settings.prefix_chars, settings.bounded_load_factor)
    if name == "kv":
        return KvAware()
    raise ValueError(f"unknown policy {name!r}")


__all__ = ["KvAware", "LeastLoaded", "PrefixAware", "RoundRobin", "make_policy"]
