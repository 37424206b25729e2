"""Cache-aware (issue 38): a request goes to the candidate holding the longest prefix of its
prompt, and stays there while that instance keeps up. It yields only when the move pays
for itself twice: the warm instance's expected wait (``Request.cached.waits``: the tokens
still to prefill there, in flight and the request's own uncached ones, over its measured
prefill rate, as ``gateway.kv.prefill`` reckons them) passes ``SPARE`` x the other's wait
plus the request's own prefill there once more, since the copy it makes in a second cache
evicts other prompts that will be prefilled again. A warm instance at its capacity, or
whose vLLM keeps ``QUEUED`` requests waiting more than the least queued one, is passed
over. Measured on an H200 (``docs/BENCHMARKS.md``): yielding on any queue or any shorter
wait made each yield a miss that evicted another prompt, a loop that took the hit ratio
from 0.75 to 0.23 as load rose.

A prompt of which nothing (or under half) is cached anywhere goes to its home: the
rendezvous hash of its head's key (``gateway.kv.index.home``) with bounded load (every
serving process's requests, ``gateway.kv.pending``), as the ``prefix`` policy places
prompts, so a prompt evicted everywhere comes back where it was and the others' caches keep
theirs. A request whose prediction is unknown goes to the least loaded.

The rule that decided is written on the prediction: ``cached`` (the longest cached
prefix), ``prefill`` (the warm instance's wait would cost more than the move),
``saturated`` (every warmer instance is full), ``home`` (nothing cached anywhere),
``short_prefix`` (less than half of the prompt cached anywhere: a shared preamble, not
this prompt) and ``least_loaded`` (a prompt too short to have a home).
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend
from gateway.routing.policies.least_loaded import LeastLoaded
from gateway.routing.policies.prefix import bounded
from gateway.types import Cached, Request

SHORT = 0.5  # a cached prefix under this share of the prompt draws no affinity
FACTOR = 1.25  # a home takes up to this x the average in flight (the prefix policy's)
SPARE = 1.1  # a warm instance's wait must pass the move's cost by this factor
QUEUED = 32  # requests vLLM keeps waiting beyond the least queued one: the warm one yields


def saturated(backend: Backend, candidates: Sequence[Backend]) -> bool:
    """Full as the instance itself says: as many in flight as its ``capacity``, or vLLM
    keeping ``QUEUED`` requests waiting more than the least queued candidate (and over
    ``SPARE`` x as many). A count of requests against the others' is no measure of a batch
    of hundreds, and a queue of a few drains in a step; spilling a prompt copies it into a
    second cache, which evicts others'."""
    if backend.capacity and backend.in_flight >= backend.capacity:
        return True
    if backend.load is None:
        return False
    waiting = backend.load.waiting
    least = min((b.load.waiting if b.load is not None else 0 for b in candidates), default=0)
    return waiting - least >= QUEUED and waiting > SPARE * least


class KvAware:
    def __init__(self) -> None:
        self._least = LeastLoaded()

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        cached = request.cached
        if cached is None:
            return self._least.choose(candidates, request)
        open_ = [b for b in candidates if not saturated(b, candidates)] or list(candidates)
        best = max((cached.get(b.name, 0) for b in candidates), default=0)
        if best < SHORT * cached.tokens or not best:
            # Only a preamble is cached (a shared system prompt's head, a template), or
            # nothing: placed by its own head, not onto the preamble's instance.
            cached.rule = "short_prefix" if best else "home"
            if cached.home is None:
                cached.rule = cached.rule if best else "least_loaded"
                return self._least.choose(open_, request)
            return bounded(cached.home, open_, FACTOR, cached.others)
        chosen = self._warm(open_, request, cached)
        if cached.get(chosen.name, 0) == best:
            cached.rule = "cached"
        elif any(cached.get(b.name, 0) == best for b in open_):
            cached.rule = "prefill"
        else:
            cached.rule = "saturated"
        return chosen

    def _warm(self, open_: list[Backend], request: Request, cached: Cached) -> Backend:
        """The open candidate with the longest cached prefix (the least wait among equals),
        unless moving elsewhere pays for the copy it makes."""
        top = max(cached.get(b.name, 0) for b in open_)
        waits, own = cached.waits, cached.own
        warm = [b for b in open_ if cached.get(b.name, 0) == top]
        first = min((waits.get(b.name, 0.0), b.in_flight) for b in warm)
        tied = [b for b in warm if (waits.get(b.name, 0.0), b.in_flight) == first]
        # Equally good (a prefix they all hold, nothing pending): rotated, as least_loaded.
        chosen = tied[0] if len(tied) == 1 else self._least.choose(tied, request)
        cost = {b.name: waits.get(b.name, 0.0) + own.get(b.name, 0.0)
                for b in open_ if b not in warm}
        if cost:
            other = min(cost, key=cost.__getitem__)
            if waits.get(chosen.name, 0.0) > SPARE * cost[other]:
                return next(b for b in open_ if b.name == other)
        return chosen

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        return [self.choose(candidates, request)]
