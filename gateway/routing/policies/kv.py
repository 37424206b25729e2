"""Cache-aware (issue 38): the candidate that holds the longest prefix of the prompt in its
KV cache (``Request.cached``, from vLLM's own events), as long as it is not busier than
its share (bounded load, as ``prefix``: at most ``factor`` x the average in flight); a
request with no prefix cached anywhere, or whose prediction is unknown, goes to the least
loaded."""

from __future__ import annotations

import math
from collections.abc import Sequence

from backends.backend import Backend
from gateway.routing.policies.least_loaded import LeastLoaded
from gateway.types import Request


class KvAware:
    def __init__(self, load_factor: float) -> None:
        self._factor = load_factor
        self._least = LeastLoaded()

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        cached = request.cached
        if cached:
            total = sum(b.in_flight for b in candidates) + 1
            cap = math.ceil(total * self._factor / len(candidates))
            warm = sorted((b for b in candidates if cached.get(b.name, 0) > 0),
                          key=lambda b: (-cached.get(b.name, 0), b.in_flight))
            best = next((b for b in warm if b.in_flight < cap), None)
            if best is not None:
                return best
        return self._least.choose(candidates, request)

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        return [self.choose(candidates, request)]
