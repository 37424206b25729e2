"""Writing replies the way vLLM's server does, with the simulator's write faults.

A whole reply carries Content-Length (Starlette's JSONResponse), a stream is chunked.
``split`` cuts a body into writes of that many bytes (each its own HTTP chunk for a
stream), so a reader sees events and JSON split at arbitrary points.
"""

from __future__ import annotations

from backends.asgi import Send

Headers = list[tuple[bytes, bytes]]
JSON: Headers = [(b"content-type", b"application/json")]
SSE: Headers = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SimulatedCrash(Exception):
    """Raised mid-response so the server drops the connection."""


async def respond(send: Send, status: int, body: bytes, headers: Headers | None = None,
                  split: int = 0, cut: int | None = None) -> None:
    """A whole reply with Content-Length; ``cut``: drop the connection after that many bytes."""
    out = [(b"content-length", str(len(body)).encode()), *(JSON if headers is None else headers)]
    await send({"type": "http.response.start", "status": status, "headers": out})
    if cut is not None:
        if cut > 0:
            await write(send, body[:cut], split, more=True)
        raise SimulatedCrash
    await write(send, body, split)


async def write(send: Send, data: bytes, split: int = 0, more: bool = False) -> None:
    """One piece of a body, in writes of ``split`` bytes when split is set."""
    if split <= 0 or len(data) <= split:
        await send({"type": "http.response.body", "body": data, "more_body": more})
        return
    for start in range(0, len(data), split):
        last = start + split >= len(data)
        await send({"type": "http.response.body", "body": data[start:start + split],
                    "more_body": more or not last})
