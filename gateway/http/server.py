"""The front door's own limits, which uvicorn alone does not set: how long a client may take
to send its request line and headers, how many header bytes it may send, and how many
connections one process holds open.

A subclass of uvicorn's httptools protocol (the parser stays httptools, in C). The header
deadline runs from the connection's start, or on a kept-alive connection from the first
byte of the next request (idle between requests is uvicorn's keep-alive timeout), to the end
of the headers; past it the client gets a 408 (or, if it sent nothing, just the close) and
the connection is closed. Header bytes are counted as they arrive, before httptools buffers
them: past the cap the client gets a 431 and nothing more is read.

A new connection over the process's cap first closes the connection that has been idle the
longest (one that has sent nothing yet, or is kept alive between requests: closing it loses
no request, as nginx reuses its idle connections); when none is idle it gets a 503 with
Retry-After. Both are logged (at most once a second) and counted.

Every answer that closes a connection whose client may still be sending (a refusal, a 413
on a declared length, a body timeout: ``Guarded.linger``) closes the way nginx does: the
write side is shut after the answer, what the client still sends is read and dropped until
it stops for LINGER seconds or LINGER_MAX passes, then the socket is closed. Closing with
unread data makes the kernel send a reset, which destroys the answer before the client
reads it.

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
# Descriptors kept for Redis, probes, logs, files and lingering refusals: a quarter of the
# limit, between these bounds; each client connection may hold an upstream one too.
RESERVED_FDS = (64, 256)
MIN_CONNECTIONS = 32  # a descriptor limit that allows fewer cannot serve: a start-up error
# An idle connection younger than this is not closed to make room: one accepted a moment
# ago may hold its request unread in the socket, and closing it would reset the client.
MIN_IDLE_AGE = 0.1


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
# After an answer that closes, what the client still sends is read and dropped until it
# stops this long, and at most LINGER_MAX in all (nginx: lingering_timeout, lingering_time).
LINGER = 2.0
LINGER_MAX = 30.0
REFUSED = "vgw.connections_refused"  # the lifespan's state: the metric counting refusals
EVICTED = "vgw.connections_evicted"  # ... and the one counting idle connections closed


class DescriptorLimit(Exception):
    """The process may not open enough descriptors to serve."""


def _raised_limit() -> int:
    """The soft descriptor limit, raised to the hard one first where allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(configured: int, limit: int | None = None) -> int:
    """Client connections one process holds: what the descriptor limit (this process's,
    raised first, unless ``limit`` is given) allows, each client connection holding one
    upstream connection too, beside a reserve; or ``configured`` when lower. Raises
    DescriptorLimit, naming the limit, when it allows too few."""
    limit = _raised_limit() if limit is None else limit
    reserve = min(max(limit // 4, RESERVED_FDS[0]), RESERVED_FDS[1])
    fits = (limit - reserve) // 2
    if fits < MIN_CONNECTIONS:
        need = RESERVED_FDS[0] + 2 * MIN_CONNECTIONS
        raise DescriptorLimit(
            f"the open-files limit (RLIMIT_NOFILE) is {limit}: too low to serve; the gateway "
            f"needs at least {need} (raise it, e.g. ulimit -n 65536)")
    if configured > fits:
        log.warning("gateway.max_connections = %d needs about %d descriptors; the open-files "
                    "limit is %d, so this process holds at most %d connections",
                    configured, 2 * configured + reserve, limit, fits)
    return min(configured, fits) if configured else fits


class _Door:
    """What one server's connections share: the idle ones, oldest first, and the refused
    ones lingering (their number bounded, each holds a descriptor)."""

    __slots__ = ("idle", "lingering", "logged")

    def __init__(self) -> None:
        self.idle: dict[Guarded, float] = {}  # loop time each became idle, oldest first
        self.lingering = 0
        self.logged: dict[str, float] = {}  # each message's last line

    def log(self, message: str, *args: object) -> None:
        """At most a line a second of each message."""
        now = time.monotonic()
        if now - self.logged.get(message, 0.0) >= 1.0:
            self.logged[message] = now
            log.error(message, *args)


class _ClosingLingers:
    """The transport as a request's cycle sees it once ``Guarded.linger`` was called: its
    close lingers; the rest is the transport's."""

    def __init__(self, protocol: Guarded) -> None:
        self._protocol = protocol
        self._transport = protocol.transport

    def close(self) -> None:
        self._protocol.close_lingering()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits below (set by ``guarded``)."""

    header_timeout = 10.0
    max_header_bytes = 64 * 1024
    max_connections = 1024
    door = _Door()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_headers = True
        self._refused = False
        self._turned_away = False
        self._lingers_refused = False  # a refusal counted in door.lingering
        self._begun = self._answered = 0  # requests begun and answered on this connection
        self._received = 0  # requests whose body has all arrived
        self._draining = False  # answered, but the client still sends a body nobody read
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._hangup: Callable[[], None] | None = None
        self._heard = 0.0  # while lingering: when the client last sent something
        self._linger_ends = 0.0

    def on_hangup(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` if the client hangs up before the current response ends
        (``gateway.http.sink.Hangup``: no watcher task per request)."""
        self._hangup = callback

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._make_room():
            self._turn_away(transport)
            return
        super().connection_made(transport)
        self.door.idle[self] = self.loop.time()
        self._arm()  # a client that connects and sends nothing is closed too

    def _make_room(self) -> bool:
        """Close the connection idle the longest, if any: it has no request to lose."""
        door = self.door
        if not door.idle:
            return False
        oldest, since = next(iter(door.idle.items()))
        if self.loop.time() - since < MIN_IDLE_AGE:
            return False
        door.log("idle connection closed to make room: %d open connections, the cap "
                 "(gateway.max_connections)", len(self.connections))
        del door.idle[oldest]
        oldest.transport.close()
        self.connections.discard(oldest)  # its connection_lost comes later; the room is now
        if (evicted := self.app_state.get(EVICTED)) is not None:
            evicted.inc()
        return True

    def _turn_away(self, transport: asyncio.Transport) -> None:
        """503 with Retry-After: every connection is busy."""
        door = self.door
        self.transport, self._turned_away = transport, True
        door.log("connection refused: %d open connections, the cap (gateway.max_connections)",
                 len(self.connections))
        if (refused := self.app_state.get(REFUSED)) is not None:
            refused.inc()
        if door.lingering >= max(8, self.max_connections // 8):
            transport.write(FULL)  # too many lingering already: their descriptors are few
            transport.close()
            return
        door.lingering += 1
        self._lingers_refused = True
        self._answer(FULL)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._turned_away:
            if self._lingers_refused:
                self.door.lingering -= 1
            return
        self.door.idle.pop(self, None)
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
            self._answer(TOO_SLOW)
        else:
            self.transport.close()

    def linger(self) -> None:
        """The response about to be sent closes the connection while the client may still
        be sending its body (413, 408): the close lingers (``close_lingering``)."""
        if self.cycle is not None:
            self.cycle.transport = _ClosingLingers(self)  # type: ignore[assignment]

    def _answer(self, reply: bytes) -> None:
        """Answer the gateway's own refusal, then close lingering."""
        self.transport.write(reply)
        self.close_lingering()

    def close_lingering(self) -> None:
        """Shut the write side (the answer is whole), drop what the client still sends, and
        close once it has stopped for LINGER, has finished, or LINGER_MAX has passed."""
        self._disarm()
        self._reading_headers = False
        self._refused = True
        self.door.idle.pop(self, None)
        transport = self.transport
        if transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        if self.flow is not None:  # uvicorn paused reading: a body it was not asked for
            self.flow.resume_reading()
        self._heard = now = self.loop.time()
        self._linger_ends = now + LINGER_MAX
        self._deadline = self.loop.call_later(LINGER, self._lingered)

    def _lingered(self) -> None:
        now = self.loop.time()
        quiet_until = self._heard + LINGER
        if now < quiet_until and now < self._linger_ends:
            self._deadline = self.loop.call_later(
                min(quiet_until, self._linger_ends) - now, self._lingered)
            return
        self._deadline = None
        self.transport.close()

    def eof_received(self) -> None:
        if self._refused:  # the client has sent all it will: the lingering is over
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """httptools refused the bytes: the answer in the OpenAI error format too."""
        self._answer(MALFORMED)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._heard = self.loop.time()
            return
        if self._reading_headers:
            if self._deadline is None:  # a kept-alive connection's next request
                self._arm()
            end = data.find(END_OF_HEADERS)
            self._header_bytes += len(data) if end < 0 else end
            if self._header_bytes > self.max_header_bytes:
                self._answer(TOO_BIG)
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._begun += 1
        self.door.idle.pop(self, None)
        self._unset_keepalive_if_required()  # one set as a drained body ended, in this read
        if self._reading_headers and self._deadline is None:
            # Begun in the read that ended a drained body (its bytes were not counted as
            # headers, nor did they arm the deadline): the deadline runs from here.
            self._arm()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._reading_headers = False
        super().on_headers_complete()
        if self.cycle is not None:
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[CONNECTION] = self

    def on_message_complete(self) -> None:
        self._received += 1
        super().on_message_complete()
        if self._draining:  # the unread body has ended: the next request may begin
            self._draining = False
            self._disarm()
            self._await_next()
            if self.timeout_keep_alive_task is None:  # the body's bytes cancelled uvicorn's
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        self._hangup = None
        self._answered += 1
        pipelined = bool(self.pipeline)  # the next request's headers are in: it starts now
        super().on_response_complete()
        if self._refused or pipelined or self.transport.is_closing():
            return
        if self._received < self._answered:
            # Answered before the body was read (a 401, a 429): httptools drops the rest
            # of it, which is no header of a next request; it has header_timeout to end.
            self._draining = True
            self._deadline = self.loop.call_later(self.header_timeout, self.transport.close)
            return
        self._await_next()

    def _await_next(self) -> None:
        # Idle until the next request is uvicorn's keep-alive timeout; its headers'
        # deadline starts with its first byte. One whose headers began arriving meanwhile
        # is not idle: its deadline runs from now.
        self._reading_headers = True
        self._header_bytes = 0
        if self._begun > self._answered:
            if self._deadline is None:
                self._arm()
        else:
            self.door.idle[self] = self.loop.time()


def guarded(header_timeout: float, max_header_bytes: int,
            max_connections: int) -> type[Guarded]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    limits = {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes,
              "max_connections": max_connections, "door": _Door()}
    return type("Guarded", (Guarded,), limits)
