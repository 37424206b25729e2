"""Request ids, JSON bodies and error replies, shared by the proxy, the middleware, the app
and the admin API."""

from __future__ import annotations

import os
from typing import Any

import orjson
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
    headers = [JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


CLOSE = (b"connection", b"close")


async def send_error(send: Send, error: GatewayError, rid: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, error.status, error.body(), rid, extra)


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared body length, or None (chunked, or not a number: the server refuses
    a malformed one before the app sees it)."""
    for key, value in headers:
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyBudget:
    """Request bytes one process holds at any moment, against a cap."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if the cap allows; a negative ``n`` gives back, always."""
        if n > 0 and self.held + n > self._limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n

    def __repr__(self) -> str:
        return f"<BodyBudget [{self.held} of {self._limit} bytes]>"


def json_object(raw: bytes, error: type[GatewayError], what: str) -> dict[str, Any]:
    """``raw`` parsed as a JSON object, or ``error`` saying why not (``what`` names it)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a JSON object")
    return value
