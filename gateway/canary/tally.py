"""Every upstream attempt counted for its backend's group: metrics, and the windows the
canary analysis judges."""

from __future__ import annotations

from gateway.canary.rollout import Canary
from gateway.metrics import Children, Metrics
from gateway.resilience.breaker import Outcome, Ticket


class Tally:
    """Counts every attempt for its backend's group (metrics, and the canary's windows)."""

    def __init__(self, metrics: Metrics, canary: Canary) -> None:
        self._requests = metrics.group_requests
        self._ttft = metrics.group_ttft
        self._canary = canary
        self._child = Children()

    def attempt(self, ticket: Ticket, started: float) -> None:
        group = ticket.backend.spec.group
        outcome = ticket.outcome
        if outcome is Outcome.FAILURE:
            label = "error"
        elif outcome is Outcome.SUCCESS:
            label = "ok"
        elif 400 <= ticket.status < 500 and ticket.status != 429:
            label = "client_error"
        else:
            label = "other"  # busy, or the client left
        self._child(self._requests, group, label).inc()
        ttft = None
        if ticket.first_byte is not None and label == "ok":
            ttft = ticket.first_byte - started
            self._child(self._ttft, group).observe(ttft)
        if self._canary.enabled and label != "other":
            self._canary.observe(group, label == "error", ttft)
