"""Requests for a model whose instances are all stopped or asleep by demand (``start =
"on_demand"`` not yet started, stopped after ``stop_after`` or asleep after ``sleep_after``
idle seconds) wait here while the control plane starts or wakes one
(``gateway.control.demand``), instead of getting a 503 at once.

A waiting request marks its model wanted (the serving process tells the control plane at
its next report, a few times a second); the control plane starts one instance per wanted
model, once. The request goes on as soon as an instance of its model is routable, or
after the longest ``wake_timeout`` of those instances, when the plan finds nothing and it
gets the 503 with Retry-After that any request finds when its model has no instance.
"""

from __future__ import annotations

import asyncio
import logging
import time

from backends.backend import Backend, BackendState
from gateway.routing.pool import BackendPool

log = logging.getLogger("gateway.proxy")

POLL = 0.05  # seconds between looks at the pool while a request waits
WANTED_FOR = 2.0  # seconds a model stays wanted after a request last waited for it
# Stopped (or never started), starting, being stopped or put to sleep for idleness, asleep,
# being woken or checked: it comes (back).
ASLEEP = (BackendState.STOPPED, BackendState.STARTING, BackendState.DRAINING,
          BackendState.ASLEEP, BackendState.WAKING, BackendState.VERIFYING)


class Waking:
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool
        self._wanted: dict[str, float] = {}  # model -> monotonic time last wanted

    def wanted(self) -> list[str]:
        """The models requests waited for lately (for the control plane)."""
        now = time.monotonic()
        self._wanted = {m: t for m, t in self._wanted.items() if now - t < WANTED_FOR}
        return sorted(self._wanted)

    def dormant(self, model: str) -> list[Backend]:
        """The instances of ``model`` that demand starts, while not up."""
        return [b for b in self._pool.demanded(model) if b.state in ASLEEP]

    def within(self, model: str) -> float | None:
        """How long a request for ``model`` may wait for an instance to start; None when
        it need not (one is up, or none is started by demand)."""
        if not self._pool.on_demand or not model or self._pool.candidates(model):
            return None  # the first test is all that most requests pay
        dormant = self.dormant(model)
        if not dormant:
            return None
        return max(b.spec.spawn.wake_timeout for b in dormant if b.spec.spawn is not None)

    async def __call__(self, model: str, within: float) -> None:
        """Until ``model`` has a routable instance, or ``within`` seconds passed."""
        began = time.monotonic()
        log.info("model %s: no instance up; waiting up to %g s for one to start", model, within)
        while not self._pool.candidates(model) and time.monotonic() - began < within:
            if not self.dormant(model):
                break  # nothing left that comes back (failed, or removed by a reload)
            self._wanted[model] = time.monotonic()
            await asyncio.sleep(POLL)
        if self._pool.candidates(model):
            self._wanted.pop(model, None)  # served: no longer wanted (nor woken again)
