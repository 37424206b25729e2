"""Canary rollouts: the rollout state machine and its analysis, its sharing between replicas
through Redis, session arms, shadow traffic, and the per-group tally of every attempt that
the analysis reads.

Owns the canary state (``Canary``: changed only through its own methods). May import
``routing``, ``resilience``, ``state``, ``upstream``, ``http``, the leaves and ``backends``.
"""
