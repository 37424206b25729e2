"""The gateway's queue: requests held while every backend for their model is at capacity.

Once a request sits in one vLLM's own queue it can't move, so the gateway holds it instead
and gives it to the first backend that frees a place ("no-regret" dispatch). Waiters are
served by priority band, highest first, and within a band round robin across tenants, so
one tenant's flood does not delay another's requests. Bounded in length and in wait time
(then 503 with ``Retry-After``, counted by reason); a client that hangs up leaves at once
(its task is cancelled). Each serving process holds its own queue and its share of each
backend's capacity.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from gateway.errors import Shed
from gateway.metrics import Metrics
from gateway.tenancy import QueueSection


class NoRoom(Exception):
    """Backends serve the model, but each is at capacity: the request may wait."""


class WaitQueue:
    def __init__(self, settings: QueueSection, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        # band -> tenant -> its waiters, oldest first; tenants in turn order
        self._bands: dict[int, OrderedDict[str, deque[asyncio.Future[None]]]] = {}
        self.waiting = 0

    async def wait(self, band: int, tenant: str, front: bool = False) -> None:
        """Until a place is freed for this request (``front``: it was woken before and
        lost the place, so it goes first again); 503 when the queue is full or the wait
        runs out."""
        if self.waiting >= self._settings.max_length:
            self._metrics.shed.labels("full").inc()
            raise Shed("every backend for this model is at capacity and the gateway's queue "
                       "is full; retry shortly", "queue_full")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiters = self._bands.setdefault(band, OrderedDict()).setdefault(tenant, deque())
        (waiters.appendleft if front else waiters.append)(future)
        self.waiting += 1
        depth = self._metrics.queue_depth.labels(str(band))
        depth.inc()
        began = loop.time()
        try:
            await asyncio.wait_for(future, self._settings.max_wait)
        except TimeoutError:
            self._metrics.shed.labels("timeout").inc()
            raise Shed(f"every backend for this model stayed at capacity for "
                       f"{self._settings.max_wait:g} s; retry later", "queue_timeout") from None
        except BaseException:
            if future.done() and not future.cancelled():
                self.freed()  # woken as it left (its client hung up): the next one goes
            raise
        finally:
            self.waiting -= 1
            depth.dec()
            self._metrics.queue_wait.observe(loop.time() - began)
            self._leave(band, tenant, future)

    def _leave(self, band: int, tenant: str, future: asyncio.Future[None]) -> None:
        tenants = self._bands.get(band)
        waiters = tenants.get(tenant) if tenants is not None else None
        if waiters is not None:
            if future in waiters:
                waiters.remove(future)
            if not waiters and tenants is not None:
                del tenants[tenant]
                if not tenants:
                    del self._bands[band]

    def freed(self) -> None:
        """A place was given back: wake the next waiter (highest band; in it, the tenant
        whose turn it is, which then goes to the end of the turn order)."""
        for band in sorted(self._bands, reverse=True):
            tenants = self._bands[band]
            for tenant in list(tenants):
                waiters = tenants[tenant]
                tenants.move_to_end(tenant)
                while waiters:
                    future = waiters.popleft()
                    if not future.done():
                        future.set_result(None)
                        return
