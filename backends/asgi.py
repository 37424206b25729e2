"""Small ASGI helpers shared by the gateway and the simulator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """Read the whole request body; None if the client left, BodyTooLarge past ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if limit is not None and size > limit:
                raise BodyTooLarge(size)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def cancel_on_disconnect(receive: Receive) -> asyncio.Task[None]:
    """Cancel the calling task as soon as the client disconnects.

    Servers don't fail ``send`` after a hang-up, so without this a handler would
    keep waiting for (and paying for) an upstream answer nobody will read.
    The caller must cancel the returned watcher when it finishes normally.
    """
    owner = asyncio.current_task()
    assert owner is not None

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                owner.cancel("client disconnected")
                return

    return asyncio.get_running_loop().create_task(watch())
