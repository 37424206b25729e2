"""Fewest requests on the backend (ours in flight, or what vLLM reports running and waiting
for all its clients, whichever is more); ties rotate so equal backends share the load."""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.types import Request


class LeastLoaded:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        low = min(b.queue for b in candidates)
        tied = [b for b in candidates if b.queue == low]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def rewind(self) -> None:
        self._turn -= 1
