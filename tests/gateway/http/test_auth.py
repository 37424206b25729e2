from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.http.auth import ApiKeyAuth, Refusals, bearer


async def _app(scope: object, receive: object, send: object) -> None:
    return None


def test_bearer_keys() -> None:
    auth = ApiKeyAuth(_app, ["k1", "k2"])  # type: ignore[arg-type]
    assert auth.allows(bearer([(b"authorization", b"Bearer k2")]))
    assert auth.allows(bearer([(b"authorization", b"bearer k1")]))
    assert not auth.allows(bearer([(b"authorization", b"Bearer k3")]))
    assert not auth.allows(bearer([(b"authorization", b"Basic k1")]))
    assert not auth.allows(bearer([(b"authorization", b"Bearer ")]))
    assert not auth.allows(bearer([]))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_counted_and_logged_at_most_once_a_second_without_the_key(
        caplog: pytest.LogCaptureFixture) -> None:
    counter = Counter("t_refused", "t", ["route", "reason"], registry=CollectorRegistry())
    clock = Clock()
    refusals = Refusals(counter, clock)
    with caplog.at_level(logging.WARNING, "gateway.auth"):
        for _ in range(5):
            refusals("api", "invalid", "10.0.0.1", "/v1/models", "rid")
        clock.now = 1.5
        refusals("api", "missing", "10.0.0.1", "/v1/models", "rid2")
    assert counter.labels("api", "invalid")._value.get() == 5
    assert [r.getMessage() for r in caplog.records] == [
        "api key invalid from 10.0.0.1 on /v1/models, request rid",
        "api key missing from 10.0.0.1 on /v1/models, request rid2 (4 more since the last line)"]
