"""One upstream attempt: what its result means (a pure decision table) and its bookkeeping.

``judge`` turns an attempt's result into the breaker's ``Outcome`` and the request's ``Next``
step; nothing else on the request path maps a status to an outcome. ``Attempt`` wraps the
attempt's I/O, in the proxy and in shadow traffic alike, so the backend's in-flight count,
the ticket's outcome and the tally are settled however the attempt ends.

The tally is passed in as a callable: it lives in ``canary``, a floor above this one.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from backends.backend import Backend
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.retry import RETRIABLE, retry_after


class Failed(enum.Enum):
    """An attempt that got no reply."""

    CONNECT = "connect"  # no connection: nothing reached the backend
    TIMEOUT = "timeout"  # no response headers in time: the request may be running
    BROKEN = "broken"  # the connection broke before the headers: the same


class Next(enum.Enum):
    RELAY = "relay"  # send the reply on
    RETRY = "retry"  # try another backend; nothing reached the client yet
    DEGRADE = "degrade"  # a failed backend's reply: the reply cache answers if it can, else relay
    FAIL = "fail"  # no reply and no retry: the reply cache answers if it can, else an error


def retriable(result: int | Failed) -> bool:
    """Worth another backend, if one is left: a connect failure or a status in RETRIABLE.
    A timeout or a connection broken before the headers is not: the request may have run."""
    return result is Failed.CONNECT or result in RETRIABLE


def note_busy(status: int, retry_after_header: bytes, backend: Backend) -> bool:
    """A 429/503 with Retry-After: busy, not broken. Skip the backend that long."""
    seconds = busy_for(status, retry_after_header)
    if not seconds:
        return False
    backend.mark_busy(seconds)
    logging.getLogger("gateway.proxy").warning(
        "backend %s busy: skipped for %.1f s (Retry-After)", backend.name, seconds)
    return True


def busy_for(status: int, header: bytes) -> float:
    """Seconds a 429/503 with a ``Retry-After`` header asks to be left alone (busy, not
    broken); 0.0 for any other reply."""
    if status not in (429, 503):
        return 0.0
    return retry_after(header or None) or 0.0


def judge(result: int | Failed, busy: bool = False, retry: bool = False) -> tuple[Outcome, Next]:
    """What an attempt's result means for the backend's breaker and for the request.

    ``result`` is the reply's status or how the attempt failed; ``busy``: a 503 came with
    Retry-After; ``retry``: another attempt is allowed and paid for (asked only when
    ``retriable``). For a reply that is relayed the outcome holds if the relay ends cleanly:
    a stream that breaks is a FAILURE whatever its status, unless ``settled``.
    """
    if isinstance(result, Failed):
        return Outcome.FAILURE, Next.RETRY if retry and result is Failed.CONNECT else Next.FAIL
    if result < 500 and result != 429:
        return (Outcome.SUCCESS if result < 400 else Outcome.NEUTRAL), Next.RELAY
    outcome = Outcome.NEUTRAL if result == 429 or (busy and result == 503) else Outcome.FAILURE
    if retry and result in RETRIABLE:
        return outcome, Next.RETRY
    return outcome, Next.DEGRADE if result >= 500 else Next.RELAY


def settled(result: int | Failed) -> bool:
    """Whether the result alone settles the outcome (no reply, a 5xx, a 429): the breaker is
    told at once, before any retry or relay. Any other reply is settled by its relay."""
    return isinstance(result, Failed) or result >= 500 or result == 429


class Attempt:
    """The bookkeeping of one attempt on ``ticket.backend``, around its I/O: the in-flight
    count while it runs; then a NEUTRAL outcome if none was given (the client left, or the
    attempt was cancelled: that says nothing about the backend) and the tally.

    A plain ``with``: nothing is awaited on the way in or out, so no cancellation can fall
    between the attempt and its bookkeeping.
    """

    __slots__ = ("_started", "_tally", "_ticket")

    def __init__(self, ticket: Ticket, started: float,
                 tally: Callable[[Ticket, float], None]) -> None:
        self._ticket = ticket
        self._started = started
        self._tally = tally

    def __enter__(self) -> Ticket:
        self._ticket.backend.in_flight += 1
        self._ticket.backend.uses += 1
        return self._ticket

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        ticket = self._ticket
        ticket.backend.in_flight -= 1
        ticket.done(Outcome.NEUTRAL)  # a no-op once an outcome was given
        self._tally(ticket, self._started)


@contextmanager
def stepped_out(backend: Backend) -> Iterator[None]:
    """While a failed attempt's request is answered elsewhere (its stream continued, a
    fallback model asked), the failed backend does not count it as in flight."""
    backend.in_flight -= 1
    try:
        yield
    finally:
        backend.in_flight += 1
