"""The attempt's decision table, row by row, and the bookkeeping every attempt gets."""

from __future__ import annotations

import asyncio

import pytest

from gateway.resilience.attempt import Attempt, Failed, Next, busy_for, judge, retriable, settled
from gateway.resilience.breaker import Admission, Outcome, Ticket
from tests import factories

S, F, N = Outcome.SUCCESS, Outcome.FAILURE, Outcome.NEUTRAL

# result, busy, retry allowed -> outcome, next step, settled at once
TABLE: list[tuple[int | Failed, bool, bool, Outcome, Next, bool]] = [
    # 2xx/3xx: relayed; a success if the relay ends cleanly
    (200, False, False, S, Next.RELAY, False),
    (200, False, True, S, Next.RELAY, False),
    (204, False, False, S, Next.RELAY, False),
    (301, False, False, S, Next.RELAY, False),
    # 4xx but 429: the client's fault, relayed, says nothing of the backend
    (400, False, False, N, Next.RELAY, False),
    (404, False, True, N, Next.RELAY, False),
    (422, False, False, N, Next.RELAY, False),
    # 429, with or without Retry-After: busy, retried when it may be, else relayed
    (429, False, True, N, Next.RETRY, True),
    (429, True, True, N, Next.RETRY, True),
    (429, False, False, N, Next.RELAY, True),
    (429, True, False, N, Next.RELAY, True),
    # 5xx in RETRIABLE: a failure (a 503 with Retry-After only busy), retried or degraded
    (500, False, True, F, Next.RETRY, True),
    (500, False, False, F, Next.DEGRADE, True),
    (500, True, False, F, Next.DEGRADE, True),  # busy means something for 503 only
    (502, False, True, F, Next.RETRY, True),
    (502, False, False, F, Next.DEGRADE, True),
    (503, False, True, F, Next.RETRY, True),
    (503, False, False, F, Next.DEGRADE, True),
    (503, True, True, N, Next.RETRY, True),
    (503, True, False, N, Next.DEGRADE, True),
    (504, False, True, F, Next.RETRY, True),
    (504, False, False, F, Next.DEGRADE, True),
    # 5xx not in RETRIABLE: never retried, even with retries left
    (501, False, True, F, Next.DEGRADE, True),
    (505, False, False, F, Next.DEGRADE, True),
    # no reply: a connect failure may be retried; a timeout or a break may have run
    (Failed.CONNECT, False, True, F, Next.RETRY, True),
    (Failed.CONNECT, False, False, F, Next.FAIL, True),
    (Failed.TIMEOUT, False, True, F, Next.FAIL, True),
    (Failed.TIMEOUT, False, False, F, Next.FAIL, True),
    (Failed.BROKEN, False, True, F, Next.FAIL, True),
    (Failed.BROKEN, False, False, F, Next.FAIL, True),
]


@pytest.mark.parametrize(("result", "busy", "retry", "outcome", "step", "now"), TABLE)
def test_judge(result: int | Failed, busy: bool, retry: bool, outcome: Outcome, step: Next,
               now: bool) -> None:
    assert judge(result, busy, retry) == (outcome, step)
    assert settled(result) is now


@pytest.mark.parametrize(("result", "expected"), [
    (200, False), (404, False), (429, True), (500, True), (501, False), (502, True),
    (503, True), (504, True), (505, False),
    (Failed.CONNECT, True), (Failed.TIMEOUT, False), (Failed.BROKEN, False),
])
def test_retriable(result: int | Failed, expected: bool) -> None:
    """The proxy asks for (and pays for) a retry only when this says so."""
    assert retriable(result) is expected


def test_shadow_rows() -> None:
    """Shadow traffic judges a status alone: 5xx a failure, 4xx neutral, the rest success."""
    assert [judge(s)[0] for s in (200, 404, 429, 500, 503)] == [S, N, N, F, F]


@pytest.mark.parametrize(("status", "header", "seconds"), [
    (429, b"3", 3.0), (503, b"1.5", 1.5), (429, b"", 0.0), (503, b"0", 0.0),
    (503, b"soon", 0.0), (500, b"3", 0.0), (200, b"3", 0.0), (429, b"9999", 300.0),
])
def test_busy_for(status: int, header: bytes, seconds: float) -> None:
    assert busy_for(status, header) == seconds


class Tally:
    def __init__(self) -> None:
        self.seen: list[tuple[Outcome | None, int, float]] = []

    def __call__(self, ticket: Ticket, started: float) -> None:
        self.seen.append((ticket.outcome, ticket.backend.in_flight, started))


def attempt(tally: Tally) -> tuple[Attempt, Ticket]:
    ticket = Ticket(factories.backend(ready=True), Admission.UNGUARDED)
    return Attempt(ticket, 1.5, tally), ticket


def test_attempt_success() -> None:
    tally = Tally()
    a, ticket = attempt(tally)
    with a as t:
        assert t is ticket and ticket.backend.in_flight == 1
        ticket.done(Outcome.SUCCESS)
    assert ticket.backend.in_flight == 0
    assert tally.seen == [(S, 0, 1.5)]  # the outcome given stands


def test_attempt_error() -> None:
    tally = Tally()
    a, ticket = attempt(tally)
    with pytest.raises(RuntimeError), a:
        raise RuntimeError("boom")
    assert ticket.backend.in_flight == 0
    assert tally.seen == [(N, 0, 1.5)]  # no outcome given: neutral


def test_attempt_loop_exits() -> None:
    """``continue`` and ``break`` out of the ``with`` settle it too (the proxy's retry)."""
    tally = Tally()
    a, ticket = attempt(tally)
    for _ in range(2):
        with a:
            ticket.done(Outcome.FAILURE)
            continue
    assert ticket.backend.in_flight == 0
    assert tally.seen == [(F, 0, 1.5), (F, 0, 1.5)]


def test_attempt_cancelled() -> None:
    tally = Tally()
    a, ticket = attempt(tally)

    async def run() -> None:
        with a:
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(run())
        await asyncio.sleep(0)
        assert ticket.backend.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ticket.backend.in_flight == 0
    assert tally.seen == [(N, 0, 1.5)]
