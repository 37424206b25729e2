"""Gateway API keys: a pure ASGI middleware guarding the OpenAI routes."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.http.asgi import request_id, send_error


class ApiKeyAuth:
    """Requires ``Authorization: Bearer <key>`` on every path under ``prefix``.

    With no keys configured every request passes (the app logs that once at start).
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str], prefix: str = "/v1/") -> None:
        self._app = app
        self._keys = [k.encode() for k in keys]
        self._prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._keys and scope["type"] == "http" and scope["path"].startswith(self._prefix):
            if not self.allows(scope["headers"]):
                await send_error(send, Unauthorized(
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."),
                    request_id(scope))
                return
        await self._app(scope, receive, send)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        presented = b""
        for key, value in headers:
            if key == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
                break
        # Compare against every key, so timing says nothing about which one matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok and bool(presented)
