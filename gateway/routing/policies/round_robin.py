"""Each candidate in turn, whatever its load, in proportion to its weight (the baseline
sticky routing is measured against)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.routing.policies.weighted import SmoothWeights
from gateway.types import Request


class RoundRobin:
    def __init__(self) -> None:
        self._turns = SmoothWeights()

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        return self._turns.choose(candidates)

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        return candidates
