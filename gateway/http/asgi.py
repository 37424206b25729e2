"""Request ids and error replies, shared by the proxy, the middleware and the app."""

from __future__ import annotations

import os

from starlette.types import Scope, Send

from gateway.errors import GatewayError

JSON = (b"content-type", b"application/json")


def _acceptable_id(value: bytes) -> bool:
    return 0 < len(value) <= 128 and all(0x21 <= c <= 0x7E for c in value)


def request_id(scope: Scope) -> str:
    """The client's X-Request-ID when it is sane, else a new one; cached in the scope."""
    rid: str | None = scope.get("vgw.request_id")
    if rid is None:
        for key, value in scope["headers"]:
            if key == b"x-request-id" and _acceptable_id(value):
                rid = value.decode("ascii")
                break
        else:
            rid = os.urandom(16).hex()
        scope["vgw.request_id"] = rid
    return rid


async def send_json(send: Send, status: int, body: bytes, rid: str,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [JSON, (b"x-request-id", rid.encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: GatewayError, rid: str) -> None:
    await send_json(send, error.status, error.body(), rid)
