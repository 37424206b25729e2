"""How many batch lines may be in flight at once: the batch band's share of capacity,
found as TCP finds a window. It grows by one each ``GROW`` seconds in which no interactive
request had to wait in this process's queue while the lines in flight use all it allows,
and halves (at most each ``BACKOFF`` seconds) when one did, or when interactive requests'
time to first byte rose above its low-water mark (as TCP Vegas backs off on delay: on a
compute-bound instance a batch line slows every request beside it, with no queue at all).
A line in flight is never preempted, so what the band holds when interactive traffic
rises is what that traffic waits for; the share follows the idle capacity rather than
taking all of it."""

from __future__ import annotations

import time
from collections.abc import Callable

GROW = 1.0  # seconds without an interactive wait before one more line may fly
BACKOFF = 0.5  # seconds between two halvings


class Share:
    def __init__(self, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.most = most
        self.allowed = 1
        self.in_flight = 0
        self._clock = clock
        self._changed = clock()
        self._waits = 0

    @property
    def room(self) -> bool:
        return self.in_flight < self.allowed

    def look(self, waits: int, slowed: bool = False) -> None:
        """The queue's count of interactive waits, read now, and whether interactive
        requests got slower (``Pulse.raised``): a wait since the last look, or slower
        requests, halve the share; neither for ``GROW`` seconds at full use grows it."""
        now = self._clock()
        if waits > self._waits or slowed:
            self._waits = waits
            if now - self._changed >= BACKOFF:
                self.allowed = max(1, self.allowed // 2)
                self._changed = now
            return
        if now - self._changed >= GROW:
            if self.in_flight >= self.allowed:
                self.allowed = min(self.most, self.allowed + 1)
            self._changed = now
