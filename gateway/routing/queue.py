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
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from backends.backend import Backend
from gateway.config.tenancy import QueueSection
from gateway.errors import Shed
from gateway.metrics import Metrics
from gateway.types import BATCH_BAND


class NoRoom(Exception):
    """Backends serve the model, but each is at capacity: the request may wait."""


class PinFull(Exception):
    """The session's pinned backend is at capacity while another has room: the request
    may wait a little for its own (``WaitQueue.wait_for``) before it moves."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend


class Pulse:
    """Interactive requests' time to their first byte in this process: a moving average
    and its low-water mark, which drifts up to the average over ``DRIFT`` seconds (so a
    lasting change of load or prompts is the new normal). ``raised``: the average is above
    the mark by more than ``RISE`` (the batch band backs off: its lines slow what runs
    beside them inside vLLM, which no queue in the gateway shows)."""

    ALPHA = 0.1  # weight of each new request in the average
    DRIFT = 300.0
    RISE, SLACK = 1.15, 0.005  # x the mark, + seconds

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.mean: float | None = None
        self.low: float | None = None
        self._clock = clock
        self._at = clock()

    def note(self, seconds: float) -> None:
        mean = seconds if self.mean is None else self.mean + self.ALPHA * (seconds - self.mean)
        now = self._clock()
        if self.low is None or mean < self.low:
            self.low = mean
        else:
            self.low += (mean - self.low) * min(1.0, (now - self._at) / self.DRIFT)
        self.mean, self._at = mean, now

    @property
    def raised(self) -> bool:
        return (self.mean is not None and self.low is not None
                and self.mean > self.low * self.RISE + self.SLACK)


class WaitQueue:
    def __init__(self, settings: QueueSection, metrics: Metrics, tenants: int = 1) -> None:
        self._settings = settings
        self._metrics = metrics
        # Places held per tenant in this process (for the reserve; with several tenants).
        self._reserve = 0
        self.tenants(tenants)
        self._held: dict[str, int] = {}
        # band -> tenant -> its waiters, oldest first; tenants in turn order
        self._bands: dict[int, OrderedDict[str, deque[asyncio.Future[None]]]] = {}
        self.waiting = 0
        self.interactive_waits = 0  # requests that had to wait, batch lines aside (ever)
        self.pulse = Pulse()  # interactive requests' time to first byte (the batch band's)
        self._pinned: set[asyncio.Future[None]] = set()  # sessions waiting for their own
        self.pin_wait = settings.pin_wait

    @property
    def idle(self) -> bool:
        """Nobody waits: a freed place wakes no one."""
        return not self.waiting and not self._pinned

    def tenants(self, count: int) -> None:
        """How many tenants there are (a reload may change it): the reserve needs two."""
        self._reserve = self._settings.reserve if count > 1 else 0

    async def wait_for(self, room: Callable[[], bool], seconds: float) -> bool:
        """Until ``room()`` holds (checked each time a place is freed) or ``seconds`` pass.
        Those waiting for their pinned backend are woken before the queue's next one."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not room():
            left = end - loop.time()
            if left <= 0:
                return False
            future: asyncio.Future[None] = loop.create_future()
            self._pinned.add(future)
            try:
                async with asyncio.timeout(left):  # not wait_for: it may swallow a cancel
                    await future
            except TimeoutError:
                return False
            finally:
                self._pinned.discard(future)
        return True

    async def wait(self, band: int, tenant: str, front: bool = False) -> None:
        """Until a place is freed for this request (``front``: it was woken before and
        lost the place, so it goes first again); 503 when the queue is full or the wait
        runs out."""
        waiters = self._bands.setdefault(band, OrderedDict()).setdefault(tenant, deque())
        if self.waiting >= self._settings.max_length and not self._evict(band, len(waiters)):
            if not waiters:
                self._leave(band, tenant, None)
            self._metrics.shed.labels("full").inc()
            raise _full()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        (waiters.appendleft if front else waiters.append)(future)
        self.waiting += 1
        if band != BATCH_BAND:
            self.interactive_waits += 1
        depth = self._metrics.queue_depth.labels(str(band))
        depth.inc()
        began = loop.time()
        try:
            # Not asyncio.wait_for: on Python 3.11 a cancel (the client hung up) that comes
            # once the future is done is swallowed, and the request would go on for nobody.
            async with asyncio.timeout(self._settings.max_wait):
                await future
        except TimeoutError:
            if not (future.done() and not future.cancelled() and future.exception() is None):
                self._metrics.shed.labels("timeout").inc()
                raise Shed(f"every backend for this model stayed at capacity for "
                           f"{self._settings.max_wait:g} s; retry later",
                           "queue_timeout") from None
            # woken in the very turn its wait ran out: it goes
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.freed()  # woken as it left (its client hung up): the next one goes
            raise
        finally:
            self.waiting -= 1
            depth.dec()
            self._metrics.queue_wait.observe(loop.time() - began)
            self._leave(band, tenant, future)

    def _evict(self, band: int, mine: int) -> bool:
        """The queue is full: make room for a request whose tenant has ``mine`` waiting,
        by letting go the newest waiter of the tenant with the most (a lower band's
        first). False when no tenant has more than this one: the newcomer is refused."""
        for lower in sorted(b for b in self._bands if b <= band):
            tenants = self._bands[lower]
            most = max(tenants, key=lambda t: len(tenants[t]), default=None)
            # A lower band yields any waiter; the same band only one of a tenant that
            # would still have more waiting than the newcomer's.
            if most is not None and len(tenants[most]) > (mine + 1 if lower == band else 0):
                victim = tenants[most].pop()
                if not victim.done():
                    victim.set_exception(_full())
                    self._metrics.shed.labels("full").inc()
                return True
        return False

    def _leave(self, band: int, tenant: str, future: asyncio.Future[None] | None) -> None:
        tenants = self._bands.get(band)
        waiters = tenants.get(tenant) if tenants is not None else None
        if waiters is not None:
            if future is not None and future in waiters:
                waiters.remove(future)
            if not waiters and tenants is not None:
                del tenants[tenant]
                if not tenants:
                    del self._bands[band]

    def reserve_for(self, tenant: str) -> int:
        """The places ``tenant`` may not take: none while it holds fewer than the tenant
        holding the most, else the reserve."""
        if not self._reserve:
            return 0
        held = self._held
        mine = held.get(tenant, 0)
        return 0 if any(n > mine for n in held.values()) or not held else self._reserve

    def skips(self, tenant: str) -> bool:
        """May ``tenant`` go before those waiting? Only to a place reserved for it."""
        return bool(self._reserve) and not self.reserve_for(tenant)

    def take(self, tenant: str) -> None:
        if self._reserve:
            self._held[tenant] = self._held.get(tenant, 0) + 1

    def give(self, tenant: str) -> None:
        if self._reserve:
            left = self._held.get(tenant, 0) - 1
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def freed(self) -> None:
        """A place was given back: wake the next waiter (highest band; in it, the tenant
        whose turn it is, which then goes to the end of the turn order). Sessions waiting
        for their pinned backend look first: each checks whether the place is on its own."""
        for future in self._pinned:
            if not future.done():
                future.set_result(None)
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


def _full() -> Shed:
    return Shed("every backend for this model is at capacity and the gateway's queue is "
                "full; retry shortly", "queue_full")
