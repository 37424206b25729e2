"""Which backend takes a request: the session's pin first, else the policy.

The pool filters the candidates (routable, serves the model, in the group, breaker
allows; ``BackendPool.candidates``) once, before any policy runs, and the router drops
those already tried; then the breaker admits the choice and hands out a ticket for the
outcome. When breakers would leave nothing, the panic rule may offer the least-bad
backends instead. Pins live in Redis (``PinStore``); when Redis can't answer, sessions
are spread by rendezvous hashing, which every gateway process computes the same way.
The canary arm (``group``) is chosen before, by ``gateway.canary.arms``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

from backends.backend import Backend
from gateway.config import RoutingSection
from gateway.metrics import Metrics
from gateway.resilience.breaker import Breakers, Ticket
from gateway.routing.hashing import rendezvous
from gateway.routing.pins import PinStore
from gateway.routing.pool import BackendPool
from gateway.routing.queue import NoRoom, PinFull, WaitQueue
from gateway.types import Policy, Request

KV_FULL = 0.99  # vLLM's KV-cache use at which a new request would wait inside vLLM


class Router:
    def __init__(self, pool: BackendPool, policy: Policy, store: PinStore | None,
                 settings: RoutingSection, metrics: Metrics, breakers: Breakers,
                 pin_policy: Policy | None = None, processes: int = 1) -> None:
        self._pool = pool
        self._processes = processes  # each process takes its share of a backend's capacity
        self._pin_policy = pin_policy or policy
        self._breakers = breakers
        self.pins_made: dict[str, int] = {}  # sessions this process pinned, per backend
        self._policy = policy
        self.store = store if settings.sticky else None
        self._max_load = settings.session_max_load_factor
        self._sticky = metrics.sticky

    async def choose(self, request: Request, group: str | None,
                     exclude: Sequence[Backend] = (), reserve: int = 0,
                     pin_wait: bool = False, sticky: bool = True) -> Ticket | None:
        """A backend of ``group`` admitted by its breaker, or None when there is none.
        ``pin_wait``: a session pinned to a backend at capacity raises ``PinFull`` while
        another has room, instead of moving at once. ``sticky=False``: a session's backend
        is hashed and its pin left as it is (a request served outside its canary arm)."""
        exclude = list(exclude)
        while True:
            candidates = [b for b in self._pool.candidates(request.model, group)
                          if b not in exclude]
            full: list[Backend] = []
            if candidates and any(b.capacity for b in candidates):
                full = [b for b in candidates if not self._room(b, reserve)]
                candidates = [b for b in candidates if b not in full]
                if not candidates:
                    raise NoRoom
            if candidates:
                backend = await self._pick(request, candidates, full if pin_wait else (), sticky)
                ticket = self._breakers.admit(backend)
            else:
                panic = self._panic(request, group, exclude)
                if not panic:
                    return None
                backend = self._policy.choose(panic, request)
                ticket = self._breakers.admit(backend, panic=True)
            if ticket is not None:
                return ticket
            # Its half-open probe slots filled up while we waited on Redis: look again.
            exclude.append(backend)

    async def place(self, request: Request, group: str | None, tried: list[Backend],
                    queue: WaitQueue, tenant: str, band: int,
                    sticky: bool = True) -> Ticket | None:
        """``choose``; while every backend is at capacity, the request waits its turn in
        ``queue`` (behind those already waiting, unless a reserved place is its to take).
        A session whose pinned backend is at capacity while another has room waits up to
        ``queue.pin_wait`` for a place on its own, then moves."""
        front = False
        if queue.waiting and not queue.skips(tenant):
            await queue.wait(band, tenant)
            front = True
        pin_wait = queue.pin_wait  # what is left of it
        while True:
            reserve = queue.reserve_for(tenant)
            try:
                return await self.choose(request, group, tried, reserve, pin_wait > 0, sticky)
            except NoRoom:
                await queue.wait(band, tenant, front)
                front = True
            except PinFull as full:
                loop = asyncio.get_running_loop()
                began = loop.time()
                if await queue.wait_for(partial(self._room, full.backend, reserve), pin_wait):
                    pin_wait = max(pin_wait - (loop.time() - began), 1e-3)
                else:
                    pin_wait = 0.0  # it did not free in time: the session moves

    def _room(self, backend: Backend, reserve: int) -> bool:
        """Below its capacity (this process's share of it, less the ``reserve`` places the
        caller may not take), or without one. A backend with a capacity is also full while
        vLLM says it runs that many and queues more (other clients' included), or its KV
        cache is full, and this process has some of its requests in flight (whose end wakes
        the queue). A request waiting a scheduler step in vLLM alone is not saturation."""
        cap = backend.capacity
        if not cap:
            return True
        share = -(-cap // self._processes)
        load = backend.load
        if load is not None and backend.in_flight and (
                (load.waiting > 0 and load.running >= cap)
                or (load.kv_usage or 0.0) >= KV_FULL):
            return False
        return backend.in_flight < share - min(reserve, share - 1)

    def can_retry(self, request: Request, group: str | None,
                  tried: Sequence[Backend]) -> bool:
        """Is there another backend an attempt could go to?"""
        return any(b not in tried for b in self._pool.candidates(request.model, group)) or bool(
            self._panic(request, group, tried))

    def _panic(self, request: Request, group: str | None,
               exclude: Sequence[Backend]) -> list[Backend]:
        return self._breakers.least_bad(
            [b for b in self._pool.ejected(request.model, group) if b not in exclude])

    async def _pick(self, request: Request, candidates: list[Backend],
                    full: Sequence[Backend] = (), sticky: bool = True) -> Backend:
        if request.session_key is None or self.store is None:
            return self._policy.choose(candidates, request)
        key = f"{request.model}:{request.session_key}"
        if not sticky:
            hashed = rendezvous(key.encode(), candidates)
            assert hashed is not None
            return hashed
        # Where the session goes if it is new, decided before asking: the claim and the
        # lookup are then one round trip. A pinned session takes its choice back.
        choice = self._pin_policy.choose(candidates, request)
        answered, pinned = await self.store.claim(key, choice.name)
        if answered and pinned is None:
            self._sticky.labels("miss").inc()
            self.pins_made[choice.name] = self.pins_made.get(choice.name, 0) + 1
            return choice
        self._pin_policy.rewind(choice)
        if not answered:
            self._sticky.labels("fallback").inc()
            fallback = rendezvous(key.encode(), candidates)
            assert fallback is not None
            return fallback
        current = next((b for b in candidates if b.name == pinned), None)
        if current is None and (held := next((b for b in full if b.name == pinned), None)):
            raise PinFull(held)  # its own is at capacity: it may wait a little for it
        if current is not None and not self._overloaded(current, candidates):
            self._sticky.labels("hit").inc()
            return current
        # The pinned backend is gone, unhealthy, draining, tried or overloaded: move the
        # session on purpose, and keep it where it lands.
        others = [b for b in candidates if b is not current] or candidates
        policy = self._policy if current is not None else self._pin_policy
        choice = policy.choose(others, request)
        await self.store.repin(key, choice.name)
        self._sticky.labels("repin" if current is None else "rebalance").inc()
        self.pins_made[choice.name] = self.pins_made.get(choice.name, 0) + 1
        return choice

    def _overloaded(self, backend: Backend, candidates: Sequence[Backend]) -> bool:
        if not self._max_load or len(candidates) < 2:
            return False
        average = sum(b.in_flight for b in candidates) / len(candidates)
        return backend.in_flight > max(1.0, average * self._max_load)
