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
from gateway.routing.policies.weighted import in_turn
from gateway.routing.pool import BackendPool
from gateway.routing.queue import NoRoom, PinFull, WaitQueue
from gateway.types import BATCH_BAND, Facts, Policy, Request

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

    def choose(self, request: Request, group: str | None, exclude: Sequence[Backend] = (),
               reserve: int = 0, pin_wait: bool = False, facts: Facts | None = None,
               sticky: bool = True) -> Ticket | None:
        """A backend of ``group`` admitted by its breaker, or None when there is none; no
        I/O. ``facts``: what Redis said of the request's session (None: its session is not
        followed). ``pin_wait``: a session pinned to a backend at capacity raises
        ``PinFull`` while another has room, instead of moving at once. ``sticky=False``: a
        session's backend is hashed and its pin left as it is (a request served outside
        its canary arm)."""
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
                backend = self._pick(request, candidates, full if pin_wait else (),
                                     facts, sticky)
                ticket = self._breakers.admit(backend)
            else:
                panic = self._panic(request, group, exclude)
                if not panic:
                    return None
                backend = self._policy.choose(panic, request)
                ticket = self._breakers.admit(backend, panic=True)
            if ticket is not None:
                return ticket
            exclude.append(backend)  # its half-open probe slots are taken: look again

    async def place(self, request: Request, group: str | None, tried: list[Backend],
                    queue: WaitQueue, tenant: str, band: int, facts: Facts | None,
                    sticky: bool = True) -> Ticket | None:
        """``choose``; while every backend is at capacity, the request waits its turn in
        ``queue`` (behind those already waiting, unless a reserved place is its to take).
        A session whose pinned backend is at capacity while another has room waits up to
        ``queue.pin_wait`` for a place on its own, then moves."""
        front = False
        # A batch line never takes a place reserved for its key: it waits behind everyone.
        if queue.waiting and (band == BATCH_BAND or not queue.skips(tenant)):
            await queue.wait(band, tenant)
            front = True
        pin_wait = queue.pin_wait  # what is left of it
        while True:
            reserve = queue.reserve_for(tenant)
            try:
                return self.choose(request, group, tried, reserve, pin_wait > 0, facts, sticky)
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

    def propose(self, request: Request,
                group: str | None) -> tuple[tuple[str, ...] | None, bool]:
        """Where a new session of ``request`` may be pinned, before its pin is looked up:
        the candidates the pin policy holds equally good, in their turn order (the lookup
        pins a new session to the next of them; a pinned one takes no turn), or None when
        its session is not followed here; and whether one backend alone could take the
        request now (then its pin need not be read before it goes)."""
        if request.session_key is None or self.store is None:
            return None, False
        candidates = self._pool.candidates(request.model, group)
        if not candidates:
            return None, False
        roomy = [b for b in candidates if self._room(b, 0)]
        if len(candidates) == 1:
            return (candidates[0].name,), bool(roomy)
        return in_turn(self._pin_policy.ties(roomy or candidates, request)), False

    def _pick(self, request: Request, candidates: list[Backend], full: Sequence[Backend],
              facts: Facts | None, sticky: bool) -> Backend:
        """The session's pinned backend while it can take it (for a new session: the one
        proposed and claimed), else the policy's choice, kept in Redis off the request's
        path as the session's new pin."""
        if request.session_key is None or self.store is None or facts is None:
            return self._policy.choose(candidates, request)
        key = f"{request.model}:{request.session_key}"
        if not sticky or not facts.answered:
            if sticky:
                self._sticky.labels("fallback").inc()
            hashed = rendezvous(key.encode(), candidates)
            assert hashed is not None
            return hashed
        pinned = facts.pin
        current = next((b for b in candidates if b.name == pinned), None)
        if current is None and not facts.new and (
                held := next((b for b in full if b.name == pinned), None)):
            raise PinFull(held)  # its own is at capacity: it may wait a little for it
        if current is not None and (facts.new or not self._overloaded(current, candidates)):
            self._count(current, facts.unread or ("miss" if facts.new else "hit"))
            facts.new = False  # a retry of this request finds it pinned
            return current
        if pinned is None or facts.new:  # a new session whose proposal can't take it
            choice, label = self._pin_policy.choose(candidates, request), "miss"
        else:  # gone, unhealthy, draining, tried or overloaded: moved on purpose, kept there
            others = [b for b in candidates if b is not current] or candidates
            policy = self._policy if current is not None else self._pin_policy
            choice = policy.choose(others, request)
            label = "repin" if current is None else "rebalance"
        self.store.keep(key, choice.name, new=pinned is None)
        facts.pin, facts.new = choice.name, False  # a retry of this request moves from here
        self._count(choice, label)
        return choice

    def _count(self, backend: Backend, label: str) -> None:
        self._sticky.labels(label).inc()
        if label not in ("hit", "sole"):  # a sole one is counted when its claim says new
            self.made(backend.name)

    def made(self, name: str) -> None:
        """A session was pinned to backend ``name`` by this process."""
        self.pins_made[name] = self.pins_made.get(name, 0) + 1

    def _overloaded(self, backend: Backend, candidates: Sequence[Backend]) -> bool:
        if not self._max_load or len(candidates) < 2:
            return False
        average = sum(b.in_flight for b in candidates) / len(candidates)
        return backend.in_flight > max(1.0, average * self._max_load)
