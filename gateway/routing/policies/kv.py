"""Cache-aware (issue 38): among the candidates that are not saturated (``saturated``: at
their capacity, or vLLM queueing), the one where the request's prefill would end first:
its expected wait is the tokens still to prefill there (in flight, and the request's own
that it does not hold cached) over its measured prefill rate (``Request.cached.waits``, as
``gateway.kv.prefill`` reckons them). So the longest cached prefix wins while its instance keeps
up, and affinity yields exactly when the warm instance's extra wait would exceed what its
cache saves. A request with nothing cached anywhere, or whose prediction is unknown, goes
to the least loaded.

The rule that decided is written on the prediction: ``cached`` (the longest cached
prefix), ``prefill`` (a warmer instance would have made it wait longer), ``saturated``
(every warmer instance is full), ``least_loaded`` (nothing cached anywhere),
``short_prefix`` (less than half of the prompt cached anywhere: a shared preamble, not
this prompt: spread as least_loaded).
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.routing.policies.least_loaded import LeastLoaded
from gateway.types import Request

SHORT = 0.5  # a cached prefix under this share of the prompt draws no affinity


def saturated(backend: Backend) -> bool:
    """Full as the instance itself says: as many in flight as its ``capacity``, or vLLM
    keeping requests waiting that it cannot batch (its scraped ``num_requests_waiting``).
    A count of requests against the others' is no measure: a few in flight are nothing to
    a batch of hundreds, and spilling a prompt copies it into a second cache, which evicts
    others' (measured on the H100: `docs/BENCHMARKS.md`)."""
    if backend.capacity and backend.in_flight >= backend.capacity:
        return True
    load = backend.load
    return load is not None and load.waiting > 0


class KvAware:
    def __init__(self) -> None:
        self._least = LeastLoaded()

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        cached = request.cached
        best = max((cached.get(b.name, 0) for b in candidates), default=0) if cached else 0
        if cached is None or not best:
            if cached is not None:
                cached.rule = "least_loaded"
            return self._least.choose(candidates, request)
        if best < SHORT * cached.tokens:
            # Only a preamble is cached (a shared system prompt's head, a template): the
            # prompt's own content is new, and following the preamble would pile every new
            # prompt onto one instance's cache. Spread instead; a prompt seen before is
            # then found where it went.
            cached.rule = "short_prefix"
            return self._least.choose(candidates, request)
        open_ = [b for b in candidates if not saturated(b)] or list(candidates)
        waits = cached.waits

        def rank(b: Backend) -> tuple[float, int, int]:
            return waits.get(b.name, 0.0), -cached.get(b.name, 0), b.in_flight
        first = min(rank(b) for b in open_)
        tied = [b for b in open_ if rank(b) == first]
        # Equally good (a prefix they all hold, nothing pending): rotated, as least_loaded.
        chosen = tied[0] if len(tied) == 1 else self._least.choose(tied, request)
        if cached.get(chosen.name, 0) == best:
            cached.rule = "cached"
        elif any(cached.get(b.name, 0) == best for b in open_):
            cached.rule = "prefill"
        else:
            cached.rule = "saturated"
        return chosen

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        return [self.choose(candidates, request)]
