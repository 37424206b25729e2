"""One circuit breaker per backend: pybreaker's state machine, admitted and fed from asyncio.

pybreaker is built for synchronous calls, and each of its traps is designed around here:

- Decorating an ``async def`` never trips it: nothing here wraps a coroutine. The request
  path asks ``admit()`` before an attempt and reports the attempt's ``Outcome`` after it;
  the outcome is replayed through ``CircuitBreaker.call`` as a plain synchronous call, so
  pybreaker's own counters, transitions and listeners do the bookkeeping.
- ``calling()`` admits every concurrent call in half-open: admission is ours, and in
  half-open it hands out at most ``half_open_probes`` tickets at a time.
- Excluded errors count as successes and reset the failure streak: a backend 4xx (the
  client's fault), a busy 429/503 or a client hang-up is ``NEUTRAL`` and never reaches
  pybreaker at all, so a streak of 5xx interleaved with 400s still trips.
- ``CircuitRedisStorage`` blocks the event loop: state lives in memory; openings are shared
  with other processes by ``BreakerSync`` through the async ``RedisLink``.

A ticket remembers the breaker's generation (bumped on every state change): the outcome of
a request admitted before a transition is dropped instead of counting in the new state.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pybreaker

from backends.backend import Backend
from gateway.config import BreakerSection
from gateway.metrics import Metrics

log = logging.getLogger("gateway.breaker")

CLOSED, OPEN, HALF_OPEN = pybreaker.STATE_CLOSED, pybreaker.STATE_OPEN, pybreaker.STATE_HALF_OPEN
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # connect error, timeout, 5xx, dropped stream, in-band error
    NEUTRAL = "neutral"  # backend 4xx, busy with Retry-After, client hang-up: not its health


class Admission(enum.Enum):
    CLOSED = "closed"
    PROBE = "probe"  # one of the few requests let through in half-open
    PANIC = "panic"  # routed past an open breaker by the panic rule: outcome not counted
    UNGUARDED = "unguarded"  # breakers disabled


class BackendFailure(Exception):
    """What an attempt's failure looks like to pybreaker."""


@dataclass(slots=True)
class Ticket:
    """One attempt on one backend: admitted by its breaker, told its outcome once."""

    backend: Backend
    admission: Admission
    breaker: Breaker | None = None
    generation: int = 0
    outcome: Outcome | None = None
    status: int = 0  # the backend's HTTP status, once known
    first_byte: float | None = None  # loop time the first body byte was relayed

    def done(self, outcome: Outcome, cause: str = "") -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        if self.breaker is not None:
            self.breaker.record(self, outcome, cause)


def _succeed() -> None:
    return None


def _fail(cause: str) -> None:
    raise BackendFailure(cause)


class Breaker:
    """The breaker of one backend. Touched only from the event loop."""

    def __init__(self, name: str, settings: BreakerSection,
                 listeners: Sequence[pybreaker.CircuitBreakerListener] = ()) -> None:
        self.name = name
        self._max_probes = settings.half_open_probes
        self._storage = pybreaker.CircuitMemoryStorage(CLOSED)
        self.generation = 0
        self.probes = 0  # probes in flight in the current half-open period
        self.remote = False  # set while applying a transition learned from another process
        self.cb = pybreaker.CircuitBreaker(
            fail_max=settings.failure_threshold, reset_timeout=settings.reset_timeout,
            success_threshold=settings.success_threshold, state_storage=self._storage,
            name=name, throw_new_error_on_trip=False,
            listeners=[_Generations(self), *listeners])

    @property
    def state(self) -> str:
        return self.cb.current_state

    @property
    def failures(self) -> int:
        return self.cb.fail_counter

    @property
    def opened_at(self) -> datetime | None:
        return self._storage.opened_at

    def _due(self) -> bool:
        opened = self._storage.opened_at
        return opened is None or datetime.now(UTC) >= opened + timedelta(
            seconds=self.cb.reset_timeout)

    def available(self) -> bool:
        """Would ``admit`` let a request through now? (No side effects.)"""
        state = self.state
        if state == CLOSED:
            return True
        if state == OPEN:
            return self._due()
        return self.probes < self._max_probes

    def admit(self, backend: Backend, panic: bool = False) -> Ticket | None:
        state = self.state
        if state == OPEN and self._due():
            self.cb.half_open()
            state = HALF_OPEN
        if state == CLOSED:
            return Ticket(backend, Admission.CLOSED, self, self.generation)
        if state == HALF_OPEN and self.probes < self._max_probes:
            self.probes += 1
            return Ticket(backend, Admission.PROBE, self, self.generation)
        if panic and state == OPEN:
            return Ticket(backend, Admission.PANIC)
        return None

    def record(self, ticket: Ticket, outcome: Outcome, cause: str) -> None:
        if ticket.generation != self.generation:
            return  # admitted before the last transition: says nothing about this state
        if ticket.admission is Admission.PROBE:
            self.probes -= 1
        if outcome is Outcome.NEUTRAL:
            return
        if outcome is Outcome.SUCCESS:
            # Closed with no failure counted, pybreaker's call would change nothing (no
            # listener of ours counts successes): skipped on every good request.
            if self.state != CLOSED or self.cb.fail_counter:
                self.cb.call(_succeed)
            return
        try:
            self.cb.call(_fail, cause)
        except (BackendFailure, pybreaker.CircuitBreakerError):
            pass

    def open_from_remote(self, opened_at: datetime) -> None:
        """Another process opened this backend's breaker: open here too, same deadline."""
        if self.state != CLOSED:
            return
        self.remote = True
        try:
            self.cb.open()
            self._storage.opened_at = opened_at
        finally:
            self.remote = False

    def __repr__(self) -> str:
        return (f"<Breaker {self.name} [{self.state} | failures {self.failures} | "
                f"probes {self.probes}]>")


class _Generations(pybreaker.CircuitBreakerListener):
    def __init__(self, breaker: Breaker) -> None:
        self._breaker = breaker

    def state_change(self, cb: pybreaker.CircuitBreaker,
                     old_state: pybreaker.CircuitBreakerState | None,
                     new_state: pybreaker.CircuitBreakerState) -> None:
        self._breaker.generation += 1
        self._breaker.probes = 0
        log.warning("breaker %s: %s -> %s%s", cb.name, old_state.name if old_state else "-",
                    new_state.name, " (from another gateway process)" if self._breaker.remote
                    else "")


class Breakers:
    """All backends' breakers, and the panic rule."""

    def __init__(self, settings: BreakerSection, names: Sequence[str],
                 listeners: Sequence[pybreaker.CircuitBreakerListener] = ()) -> None:
        self.enabled = settings.enabled
        self.panic_route = settings.panic == "route"
        self._settings = settings
        self._listeners = list(listeners)
        self.by_name: dict[str, Breaker] = {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        """A breaker for a new backend (at start, or from a config reload)."""
        if self.enabled and name not in self.by_name:
            self.by_name[name] = Breaker(name, self._settings, self._listeners)

    def add_listener(self, listener: pybreaker.CircuitBreakerListener) -> None:
        self._listeners.append(listener)
        for breaker in self.by_name.values():
            breaker.cb.add_listener(listener)

    def allows(self, backend: Backend) -> bool:
        breaker = self.by_name.get(backend.name)
        return breaker is None or breaker.available()

    def admit(self, backend: Backend, panic: bool = False) -> Ticket | None:
        breaker = self.by_name.get(backend.name)
        if breaker is None:
            return Ticket(backend, Admission.UNGUARDED)
        return breaker.admit(backend, panic)

    def least_bad(self, ejected: Sequence[Backend]) -> list[Backend]:
        """The panic rule's pick among healthy backends whose breakers are all open: those
        with the fewest failures in a row. Half-open ones with their probes out are not
        offered: they are being tested right now."""
        if not self.panic_route:
            return []
        open_ = [(self.by_name[b.name].failures, b) for b in ejected
                 if b.name in self.by_name and self.by_name[b.name].state == OPEN]
        if not open_:
            return []
        fewest = min(f for f, _ in open_)
        return [b for f, b in open_ if f == fewest]

    def status(self, name: str) -> dict[str, object] | None:
        breaker = self.by_name.get(name)
        if breaker is None:
            return None
        opened = breaker.opened_at
        return {"state": breaker.state, "failures": breaker.failures, "probes": breaker.probes,
                "opened_at": opened.isoformat() if opened and breaker.state != CLOSED else None}

    def __repr__(self) -> str:
        states = ", ".join(f"{n}={b.state}" for n, b in self.by_name.items())
        return f"<Breakers [{states or 'disabled'}]>"


class MetricsListener(pybreaker.CircuitBreakerListener):
    """Breaker state reaches Prometheus through here, never from inside the breaker."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def state_change(self, cb: pybreaker.CircuitBreaker,
                     old_state: pybreaker.CircuitBreakerState | None,
                     new_state: pybreaker.CircuitBreakerState) -> None:
        name = cb.name or ""
        self._metrics.breaker_state.labels(name).set(STATE_VALUE[new_state.name])
        self._metrics.breaker_transitions.labels(
            name, old_state.name if old_state else "none", new_state.name).inc()
