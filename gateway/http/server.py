"""The front door's own limits, which uvicorn alone does not set: how long a client may take
to send its request line and headers, how many header bytes it may send, and how many
connections one process holds open.

A subclass of uvicorn's httptools protocol (the parser stays httptools, in C). The header
deadline runs from the connection's start, or on a kept-alive connection from the first
byte of the next request (idle between requests is uvicorn's keep-alive timeout), to the end
of the headers; past it the client gets a 408 (or, if it sent nothing, just the close) and
the connection is closed. Header bytes are counted as they arrive, before httptools buffers
them: past the cap the client gets a 431 and nothing more is read (lingering a moment, so
that the answer is not lost to a reset). A connection over the process's cap gets a 503
with Retry-After and is closed at once, with a log line (at most one a second).

granian (2.8) sets the first two and caps connections by not accepting, but serves only
sockets it binds itself (the control process hands its workers one bound socket), and its
header deadline is also its keep-alive timeout (docs/BENCHMARKS.md, issue 18).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import error_body
from gateway.http.sink import CONNECTION

log = logging.getLogger("gateway.server")

END_OF_HEADERS = b"\r\n\r\n"
RESERVED_FDS = 256  # descriptors kept for Redis, probes, logs, files


def _reply(status: bytes, message: str, kind: str, code: str, extra: bytes = b"") -> bytes:
    body = error_body(message, kind, code)
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra
            + b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


TOO_SLOW = _reply(b"408 Request Timeout", "the request headers took too long",
                  "invalid_request_error", "request_timeout")
TOO_BIG = _reply(b"431 Request Header Fields Too Large", "the request headers are too large",
                 "invalid_request_error", "headers_too_large")
MALFORMED = _reply(b"400 Bad Request", "malformed HTTP request", "invalid_request_error",
                   "malformed_request")
FULL = _reply(b"503 Service Unavailable", "too many open connections; retry shortly",
              "server_error", "too_many_connections", b"retry-after: 1\r\n")
# After refusing a request, what the client still sends is read and dropped for this long
# before the close: closing with unread data makes the kernel send a reset, which can
# destroy the answer before the client reads it (nginx's lingering close).
LINGER = 2.0
REFUSED = "vgw.connections_refused"  # the lifespan's state: the metric counting refusals


def connection_cap(configured: int) -> int:
    """``configured``, or for 0 what the descriptor limit allows: each client connection may
    hold one upstream connection too. The soft limit is raised to the hard one first."""
    if configured:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return max(16, (soft - RESERVED_FDS) // 2)


class Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits below (set by ``guarded``)."""

    header_timeout = 10.0
    max_header_bytes = 64 * 1024
    max_connections = 1024
    _refused_logged = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_headers = True
        self._refused = False
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._hangup: Callable[[], None] | None = None

    def on_hangup(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` if the client hangs up before the current response ends
        (``gateway.http.sink.Hangup``: no watcher task per request)."""
        self._hangup = callback

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            now = time.monotonic()
            if now - Guarded._refused_logged >= 1.0:
                Guarded._refused_logged = now
                log.error("connection refused: %d open connections, the cap "
                          "(gateway.max_connections)", len(self.connections))
            refused = self.app_state.get(REFUSED)
            if refused is not None:
                refused.inc()
            transport.write(FULL)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:  # refused in connection_made
            return
        self._disarm()
        super().connection_lost(exc)
        hangup, self._hangup = self._hangup, None
        if hangup is not None:
            hangup()

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._header_bytes:
            self._refuse(TOO_SLOW)
        else:
            self.transport.close()

    def _refuse(self, reply: bytes) -> None:
        """Answer, then drop what the client still sends until LINGER ends."""
        self._disarm()
        self._reading_headers = False
        self._refused = True
        self.transport.write(reply)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        """httptools refused the bytes: the answer in the OpenAI error format too."""
        self._refuse(MALFORMED)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_headers:
            if self._deadline is None:  # a kept-alive connection's next request
                self._arm()
            end = data.find(END_OF_HEADERS)
            self._header_bytes += len(data) if end < 0 else end
            if self._header_bytes > self.max_header_bytes:
                self._refuse(TOO_BIG)
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._reading_headers = False
        super().on_headers_complete()
        if self.cycle is not None:
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[CONNECTION] = self

    def on_response_complete(self) -> None:
        self._hangup = None
        super().on_response_complete()
        # Idle until the next request is uvicorn's keep-alive timeout; its headers'
        # deadline starts with its first byte.
        self._reading_headers = True
        self._header_bytes = 0



def guarded(header_timeout: float, max_header_bytes: int,
            max_connections: int) -> type[Guarded]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    limits = {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes,
              "max_connections": max_connections}
    return type("Guarded", (Guarded,), limits)
