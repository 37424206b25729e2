"""The breaker around pybreaker's traps, one test per trap, and the panic rule."""

from __future__ import annotations

import asyncio
import time

import pybreaker
import pytest

from backends.backend import Backend
from gateway.config import BreakerSection
from gateway.metrics import Metrics
from gateway.resilience.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Admission,
    Breakers,
    MetricsListener,
    Outcome,
)
from tests import factories


def backend(name: str = "b0") -> Backend:
    return factories.backend(name, ready=True, models={"m"})


def breakers(**settings: object) -> Breakers:
    return Breakers(BreakerSection(**settings), ["b0", "b1"])  # type: ignore[arg-type]


def fail(br: Breakers, b: Backend, n: int) -> None:
    for _ in range(n):
        ticket = br.admit(b)
        assert ticket is not None
        ticket.done(Outcome.FAILURE, "status 500")


def wait_until_due(br: Breakers, b: Backend, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not br.allows(b):
        assert time.monotonic() < end, "breaker never became due for a probe"
        time.sleep(0.01)


def test_an_async_attempt_trips_the_breaker() -> None:
    """pybreaker never trips on a decorated coroutine; outcomes reported after the await do."""
    br, b = breakers(failure_threshold=3), backend()

    async def attempt() -> None:
        ticket = br.admit(b)
        assert ticket is not None
        await asyncio.sleep(0)
        ticket.done(Outcome.FAILURE, "connect")

    async def main() -> None:
        for _ in range(3):
            await attempt()

    asyncio.run(main())
    assert br.by_name["b0"].state == OPEN
    assert not br.allows(b) and br.admit(b) is None


def test_half_open_admits_exactly_the_configured_probes_out_of_fifty() -> None:
    br, b = breakers(failure_threshold=1, reset_timeout=0.05, half_open_probes=2), backend()
    fail(br, b, 1)
    wait_until_due(br, b)
    admitted: list[Admission] = []

    async def request() -> None:
        ticket = br.admit(b)
        if ticket is None:
            return
        admitted.append(ticket.admission)
        await asyncio.sleep(0.05)  # the probe is in flight while the others arrive
        ticket.done(Outcome.SUCCESS)

    async def main() -> None:
        await asyncio.gather(*(request() for _ in range(50)))

    asyncio.run(main())
    assert admitted == [Admission.PROBE, Admission.PROBE]
    assert br.by_name["b0"].state == CLOSED


def test_a_failed_probe_reopens_and_a_stale_outcome_is_ignored() -> None:
    br, b = breakers(failure_threshold=2, reset_timeout=0.05), backend()
    before_trip = br.admit(b)
    assert before_trip is not None
    fail(br, b, 2)
    wait_until_due(br, b)
    probe = br.admit(b)
    assert probe is not None and probe.admission is Admission.PROBE
    before_trip.done(Outcome.SUCCESS)  # admitted while closed: says nothing about now
    assert br.by_name["b0"].state == HALF_OPEN
    probe.done(Outcome.FAILURE, "status 500")
    assert br.by_name["b0"].state == OPEN


def test_neutral_outcomes_never_reset_the_failure_streak() -> None:
    """pybreaker's excluded errors count as successes; a 400 here must not."""
    br, b = breakers(failure_threshold=5), backend()
    for _ in range(4):
        fail(br, b, 1)
        for _ in range(3):
            ticket = br.admit(b)
            assert ticket is not None
            ticket.done(Outcome.NEUTRAL)  # the client's 400s in between
    assert br.by_name["b0"].failures == 4
    fail(br, b, 1)
    assert br.by_name["b0"].state == OPEN


def test_a_neutral_probe_frees_its_slot() -> None:
    br, b = breakers(failure_threshold=1, reset_timeout=0.05), backend()
    fail(br, b, 1)
    wait_until_due(br, b)
    probe = br.admit(b)
    assert probe is not None and br.admit(b) is None
    probe.done(Outcome.NEUTRAL)
    again = br.admit(b)
    assert again is not None and again.admission is Admission.PROBE


def test_an_outcome_is_reported_once() -> None:
    br, b = breakers(failure_threshold=2), backend()
    ticket = br.admit(b)
    assert ticket is not None
    ticket.done(Outcome.FAILURE, "x")
    ticket.done(Outcome.FAILURE, "x")
    assert br.by_name["b0"].failures == 1


def test_panic_offers_the_least_bad_open_breakers_only_in_route_mode() -> None:
    br, (b0, b1) = breakers(failure_threshold=2), (backend("b0"), backend("b1"))
    fail(br, b0, 2)
    fail(br, b1, 2)
    assert br.least_bad([b0, b1]) == [b0, b1]
    ticket = br.admit(b0, panic=True)
    assert ticket is not None and ticket.admission is Admission.PANIC
    ticket.done(Outcome.FAILURE, "x")  # panic traffic is not counted
    assert br.by_name["b0"].failures == 2
    assert breakers(panic="degrade").least_bad([b0]) == []


def test_open_from_remote_keeps_the_deadline() -> None:
    br, b = breakers(reset_timeout=60), backend()
    from datetime import UTC, datetime, timedelta

    opened = datetime.now(UTC) - timedelta(seconds=59.9)
    br.by_name["b0"].open_from_remote(opened)
    assert br.by_name["b0"].state == OPEN and br.by_name["b0"].opened_at == opened
    wait_until_due(br, b, timeout=2.0)


def test_transitions_reach_prometheus_through_the_listener() -> None:
    metrics = Metrics()
    br = Breakers(BreakerSection(failure_threshold=1), ["b0"], [MetricsListener(metrics)])
    fail(br, backend(), 1)
    assert metrics.breaker_state.labels("b0")._value.get() == 2
    assert metrics.breaker_transitions.labels("b0", "closed", "open")._value.get() == 1


def test_disabled_breakers_admit_everything() -> None:
    br, b = breakers(enabled=False), backend()
    for _ in range(20):
        ticket = br.admit(b)
        assert ticket is not None
        ticket.done(Outcome.FAILURE, "x")
    assert br.allows(b)


@pytest.mark.parametrize("storage_blocks", [pybreaker.CircuitRedisStorage])
def test_the_blocking_redis_storage_is_not_used(storage_blocks: type) -> None:
    br = breakers()
    assert all(not isinstance(b.cb._state_storage, storage_blocks) for b in br.by_name.values())
