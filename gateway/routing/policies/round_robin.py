"""Each candidate in turn, whatever its load (the baseline sticky routing is measured against)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.types import Request


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def rewind(self) -> None:
        self._turn -= 1
