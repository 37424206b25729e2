from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.http.auth import ApiKeyAuth, Refusals, bearer
from gateway.tenants.keyring import Keyring


async def _app(scope: object, receive: object, send: object) -> None:
    return None


def test_bearer_keys() -> None:
    auth = ApiKeyAuth(_app, Keyring.of(["k1", "k2"]))  # type: ignore[arg-type]
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


@pytest.mark.parametrize(("path", "guarded"), [
    ("/v1/chat/completions", True), ("/tokenize", True), ("/detokenize", True),
    ("/healthz", False), ("/health", False), ("/tokenize/x", False)])
def test_the_key_guards_v1_and_the_proxied_paths_outside_it(path: str, guarded: bool) -> None:
    import asyncio

    reached: list[str] = []
    sent: list[dict[str, object]] = []

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        reached.append(str(scope["path"]))

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    auth = ApiKeyAuth(app, Keyring.of(["k1"]), paths=("/tokenize", "/detokenize"))  # type: ignore[arg-type]
    scope = {"type": "http", "path": path, "headers": [], "method": "POST"}
    asyncio.run(auth(scope, None, send))  # type: ignore[arg-type]
    assert (reached == []) is guarded
    if guarded:
        assert sent[0]["status"] == 401
