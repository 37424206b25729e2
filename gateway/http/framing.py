"""HTTP/1.0 clients get every reply with a ``Content-Length``.

RFC 9112 forbids the chunked transfer coding toward an HTTP/1.0 client, and uvicorn uses it
for any reply whose length is not given. An HTTP/1.0 client has no other way to tell a whole
reply from a cut one but a length (uvicorn can't end a body by closing the connection), so
a reply without one is held until it is complete and then sent with its length: a stream
reaches such a client all at once, at its end. HTTP/1.1 clients pass straight through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Http10Framing:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") != "1.0":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Framed(send))


class _Framed:
    """A ``send`` that holds a reply without a length until its last body message."""

    __slots__ = ("_parts", "_send", "_start")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: Message | None = None
        self._parts: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            if any(k.lower() == b"content-length" for k, _ in headers):
                await self._send(message)
            else:
                self._start = message
            return
        if self._start is None or message["type"] != "http.response.body":
            await self._send(message)
            return
        self._parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self._parts)
        start, self._start, self._parts = self._start, None, []
        headers = [*start.get("headers", []), (b"content-length", str(len(body)).encode())]
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
