"""Gateway API keys: a pure ASGI middleware guarding the OpenAI routes; and the record of
refused credentials (a metric, and a log line at most once a second, never the key)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.http.asgi import request_id, send_error

TENANT = "gateway.tenant"  # the ASGI scope key naming the caller (what ``Keys.match`` gave)


class Keys(Protocol):
    """The configured API keys (``gateway.tenants.keyring.Keyring``)."""

    @property
    def open(self) -> bool:
        """No key is configured: anyone may call."""
        ...

    def match(self, presented: bytes) -> object | None:
        """Who the presented key names, or None."""
        ...

log = logging.getLogger("gateway.auth")


class Refusals:
    """Counts refused credentials; logs the first of each second with how many came since
    the last line (a flood of bad keys costs one line a second). Never logs the key."""

    def __init__(self, counter: Counter, clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter
        self._clock = clock
        self._logged = float("-inf")
        self._quiet = 0  # refusals not logged since the last line

    def __call__(self, route: str, reason: str, client: str, path: str, rid: str) -> None:
        self._counter.labels(route, reason).inc()
        now = self._clock()
        if now - self._logged < 1.0:
            self._quiet += 1
            return
        more = f" ({self._quiet} more since the last line)" if self._quiet else ""
        self._logged, self._quiet = now, 0
        log.warning("%s key %s from %s on %s, request %s%s", route, reason, client or "?",
                    path, rid, more)


class ApiKeyAuth:
    """Requires ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key``) on every path
    under ``prefix`` and on each of ``paths`` (vLLM's proxied routes outside ``/v1/``:
    ``/tokenize``...), and tells the app which tenant called (``scope[TENANT]``).

    With no keys configured every request passes (the app logs that once at start).
    """

    def __init__(self, app: ASGIApp, keys: Keys, refusals: Refusals | None = None,
                 prefix: str = "/v1/", paths: Iterable[str] = ()) -> None:
        self._app = app
        self._keys = keys
        self._refusals = refusals
        self._prefix = prefix
        self._paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._keys.open and scope["type"] == "http" and (
                scope["path"].startswith(self._prefix) or scope["path"] in self._paths):
            presented = bearer(scope["headers"])
            tenant = self._keys.match(presented)
            if tenant is None:
                rid = request_id(scope)
                if self._refusals is not None:
                    peer = scope.get("client")
                    self._refusals("api", "invalid" if presented else "missing",
                                   peer[0] if peer else "", scope["path"], rid)
                await send_error(send, Unauthorized(
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."), rid)
                return
            scope[TENANT] = tenant
        await self._app(scope, receive, send)

    def allows(self, presented: bytes) -> bool:
        return self._keys.match(presented) is not None


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The token of ``Authorization: Bearer <token>`` (else of ``x-api-key``), or b""."""
    for key, value in headers:
        if key == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    # Anthropic's clients (/v1/messages) send the key in x-api-key instead.
    return next((v.strip() for k, v in headers if k == b"x-api-key"), b"")
