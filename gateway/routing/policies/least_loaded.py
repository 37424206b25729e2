"""Fewest requests on the backend for its weight (ours in flight, or what vLLM reports
running and waiting for all its clients, whichever is more, divided by ``weight``: a backend
of weight 2 is as loaded with 2 requests as one of weight 1 with 1); ties are shared by
weight, so equal backends take turns."""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.routing.policies.weighted import SmoothWeights
from gateway.types import Request


def _load(backend: Backend) -> float:
    weight = backend.spec.weight
    return backend.queue / weight if weight else float("inf")


class LeastLoaded:
    def __init__(self) -> None:
        self._turns = SmoothWeights()

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        low = min(_load(b) for b in candidates)
        tied = [b for b in candidates if _load(b) == low]
        return self._turns.choose(tied)

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        low = min(_load(b) for b in candidates)
        return [b for b in candidates if _load(b) == low]
