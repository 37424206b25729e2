"""Load counted in tokens still to prefill, and each instance's measured prefill rate, so
that cache affinity yields exactly when it stops paying: a request's expected wait on a
backend is ``(tokens it still has to prefill + the request's uncached tokens) / its
rate``. The rate is measured per instance from the streams it served (tokens it had to
prefill, its own and those ahead of it, over the time to the first byte), not set by
hand; until an instance has been measured it counts at the others' mean (or ``PRIOR``,
which then only scales every backend alike). With several serving processes the tokens
pending are every process's, added up in a shared map (``gateway.kv.pending``), as are the
requests the kv policy sent to each backend that have not ended (its bounded load).
"""

from __future__ import annotations

from gateway.kv.pending import REQUESTS, Pending

PRIOR = 10_000.0  # tokens/s: only a common scale until a backend is measured
WEIGH = 0.2  # the weight of each new measurement in the rate (an exponential mean)
LEAST = 64  # tokens: a measurement of less prefill than this says little of the rate


class Prefill:
    """``shared``: every serving process's pending tokens and requests. Without it (no such map
    could be opened) ``scale`` stands for the serving processes that share the instances:
    each sees about 1/``scale`` of the requests, and what it holds pending is counted
    ``scale`` times, in waits and in measurements alike."""

    def __init__(self, scale: int = 1, shared: Pending | None = None) -> None:
        self.scale = 1 if shared is not None else scale
        self.shared = shared
        self.pending: dict[str, int] = {}  # this process's tokens sent and not prefilled
        self.requests: dict[str, int] = {}  # this process's requests sent and not ended
        self.rates: dict[str, float] = {}  # measured tokens/s, per backend
        self.unshared: set[str] = set()  # backends the map had no room for: counted here

    def ahead(self, backend: str) -> int:
        """Tokens sent to ``backend`` and not yet prefilled, by every serving process."""
        if self.shared is None:
            return self.scale * self.pending.get(backend, 0)
        mine = self.pending.get(backend, 0) if backend in self.unshared else 0
        return self.shared.total(backend) + mine

    def others(self, backend: str) -> int:
        """Requests the other serving processes sent to ``backend`` and that have not
        ended (0 without the map: only this process's are known, ``Backend.in_flight``)."""
        if self.shared is None or backend in self.unshared:
            return 0
        return self.shared.total(backend, REQUESTS) - self.requests.get(backend, 0)

    def entered(self, backend: str) -> None:
        """A request was sent to ``backend``."""
        self._share(backend, requests=self.requests.get(backend, 0) + 1)

    def left(self, backend: str) -> None:
        """A request sent to ``backend`` ended (or was sent elsewhere)."""
        self._share(backend, requests=self.requests.get(backend, 0) - 1)

    def rate(self, backend: str) -> float:
        rate = self.rates.get(backend)
        if rate is not None:
            return rate
        return sum(self.rates.values()) / len(self.rates) if self.rates else PRIOR

    def wait(self, backend: str, tokens: int) -> float:
        """Seconds until ``tokens`` more sent to ``backend`` would be prefilled."""
        return (self.ahead(backend) + tokens) / self.rate(backend)

    def start(self, backend: str, tokens: int) -> int:
        """``tokens`` to prefill were sent to ``backend``; what was ahead of them (of all
        the processes')."""
        ahead = self.ahead(backend)
        self._share(backend, tokens=self.pending.get(backend, 0) + tokens)
        return ahead

    def done(self, backend: str, tokens: int) -> None:
        """Those tokens are prefilled (the first byte came) or will never be (it ended)."""
        self._share(backend, tokens=self.pending.get(backend, 0) - tokens)

    def measured(self, backend: str, tokens: int, seconds: float) -> None:
        """``backend`` prefilled ``tokens`` (a request's and those ahead of it) in
        ``seconds``, from the sending to the first byte."""
        if tokens < LEAST or seconds <= 0:
            return
        sample = tokens / seconds
        rate = self.rates.get(backend)
        self.rates[backend] = sample if rate is None else rate + WEIGH * (sample - rate)

    def _share(self, backend: str, tokens: int | None = None,
               requests: int | None = None) -> None:
        """This process's new count(s) for ``backend``, kept and written to the map."""
        for count, mine in ((tokens, self.pending), (requests, self.requests)):
            if count is None:
                continue
            if count > 0:
                mine[backend] = count
            else:
                mine.pop(backend, None)
        if self.shared is None:
            return
        if self.shared.put(backend, self.pending.get(backend, 0),
                           self.requests.get(backend, 0)):
            self.unshared.discard(backend)
        else:
            self.unshared.add(backend)
