"""Gateway API keys: a pure ASGI middleware guarding the OpenAI routes; and the record of
refused credentials (a metric, and a log line at most once a second, never the key)."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.http.asgi import request_id, send_error

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
    """Requires ``Authorization: Bearer <key>`` on every path under ``prefix`` and on each of
    ``paths`` (vLLM's proxied routes outside ``/v1/``: ``/tokenize``...).

    With no keys configured every request passes (the app logs that once at start).
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str], refusals: Refusals | None = None,
                 prefix: str = "/v1/", paths: Iterable[str] = ()) -> None:
        self._app = app
        self._keys = [k.encode() for k in keys]
        self._refusals = refusals
        self._prefix = prefix
        self._paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._keys and scope["type"] == "http" and (
                scope["path"].startswith(self._prefix) or scope["path"] in self._paths):
            presented = bearer(scope["headers"])
            if not self.allows(presented):
                rid = request_id(scope)
                if self._refusals is not None:
                    peer = scope.get("client")
                    self._refusals("api", "invalid" if presented else "missing",
                                   peer[0] if peer else "", scope["path"], rid)
                await send_error(send, Unauthorized(
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."), rid)
                return
        await self._app(scope, receive, send)

    def allows(self, presented: bytes) -> bool:
        # Compare against every key, so timing says nothing about which one matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok and bool(presented)


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The token of ``Authorization: Bearer <token>``, or b"" (no header, another scheme)."""
    for key, value in headers:
        if key == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""
