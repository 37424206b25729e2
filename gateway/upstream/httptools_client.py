"""httptools as the upstream client: HTTP/1.1 on asyncio protocols, made for relaying.

aiohttp spent a third of the gateway's CPU per non-streaming request building a request the
proxy had already built, and a task wake-up per streamed chunk. This client writes the
request as the proxy built it (adding ``Host`` and ``Content-Length``), parses the reply with
httptools (llhttp, the C parser uvicorn serves with), and hands each body chunk either to a
reader (``read``) or, for a relayed stream, to a callback inside the same ``data_received``
(``pump``): a chunk then reaches the client's socket with no task switch at all.

Connections are kept alive per backend (most recently used first) up to ``max_connections``
in all and ``max_connections_per_backend`` each; a caller over the limit waits for one. A
kept-alive connection the backend closed just as it was reused (nothing came back) is
retried once on a fresh one, as browsers and urllib3 do.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import httptools

from gateway.config import UpstreamSection
from gateway.upstream.base import ConnectFailed, Headers, UpstreamBroken

KEEPALIVE = 60.0  # seconds an idle connection is kept
HIGH_WATER = 1 << 20  # body bytes buffered for a slow reader before reading pauses
Write = Callable[[bytes], bool]  # takes a chunk; True when the receiver wants a pause


class _Conn(asyncio.Protocol):
    """One connection and the reply in progress on it."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = self.busy = self.reused = False
        self.counted = True  # holds one of the origin's slots until it is gone
        self.idle_since = 0.0
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.head = self.complete = self.received = self.paused = self.framed = False
        self.keep = self.interim = False
        self.error: UpstreamBroken | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Write | None = None
        self.drained: Callable[[], Awaitable[None]] | None = None
        self.resume: asyncio.Task[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection can't be trusted
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"unreadable reply: {exc}")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.origin.gone(self)
        if self.busy and not self.complete:
            if self.head and not self.framed:  # no length, not chunked: ends at close
                self.on_message_complete()
            else:
                self._fail("the backend closed the connection"
                           + (" mid-reply" if self.head else " before its response headers"))

    def pause_writing(self) -> None:  # a request body bigger than the socket buffer: fine
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or lower == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # informational (100 Continue): the reply follows
            self.headers, self.framed, self.interim = [], False, True
            return
        self.keep = self.parser.should_keep_alive()  # the parser forgets it at the end
        self.head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            if self.sink(body) and not self.paused and self.drained is not None:
                self._pause(self.drained)
            return
        self.chunks.append(body)
        self.size += len(body)
        if self.size > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # the client's side
    def send(self, head: bytes, body: bytes) -> None:
        self._begin()
        self.busy = True
        assert self.transport is not None
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def wait(self) -> None:
        """Until something happens: headers, body, the end, or a failure."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        chunks, self.chunks, self.size = self.chunks, [], 0
        if self.paused and self.sink is None:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def abort(self) -> None:
        self.busy = False
        if self.resume is not None:
            self.resume.cancel()
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
        self.origin.gone(self)  # its slot is free now, not when the loop gets to it

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = UpstreamBroken(why)
        self._wake()

    def _pause(self, drained: Callable[[], Awaitable[None]]) -> None:
        """The client can't take more now: stop reading the backend until it can."""
        self.paused = True
        self.transport.pause_reading()  # type: ignore[union-attr]

        async def resume() -> None:
            await drained()
            self.paused = False
            if not self.closed:
                self.transport.resume_reading()  # type: ignore[union-attr]

        self.resume = asyncio.create_task(resume())


class _Origin:
    """The connections to one backend (scheme, host, port)."""

    def __init__(self, client: HttptoolsUpstream, host: str, port: int,
                 tls: ssl.SSLContext | None, limit: int) -> None:
        self.client = client
        self.host, self.port, self.tls, self.limit = host, port, tls, limit
        self.idle: list[_Conn] = []
        self.open = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> _Conn:
        loop = asyncio.get_running_loop()
        while True:
            while self.idle:
                conn = self.idle.pop()
                if not conn.closed:
                    conn.reused = True
                    return conn
            if self.open < self.limit and self.client.open < self.client.limit:
                return await self._connect(loop)
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        self.open += 1
        self.client.open += 1
        conn = _Conn(self)
        try:
            async with asyncio.timeout(self.client.connect_timeout):
                await loop.create_connection(lambda: conn, self.host, self.port, ssl=self.tls)
        except (OSError, TimeoutError) as exc:
            self.gone(conn)
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        except BaseException:
            conn.abort()
            self.gone(conn)
            raise
        return conn

    def release(self, conn: _Conn) -> None:
        conn.busy = conn.reused = False
        conn.idle_since = asyncio.get_running_loop().time()
        self.idle.append(conn)
        self.client.sweep_soon()
        self._wake()

    def gone(self, conn: _Conn) -> None:
        """A connection closed (or never opened): its slot is free."""
        if not conn.counted:
            return
        conn.counted = False
        self.open -= 1
        self.client.open -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        if not self._wake():
            self.client.wake_any()

    def _wake(self) -> bool:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return True
        return False

    def sweep(self, now: float) -> None:
        stale = [c for c in self.idle if now - c.idle_since > KEEPALIVE]
        for conn in stale:
            conn.abort()


class HttptoolsResponse:
    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers

    async def read(self) -> bytes:
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            await conn.wait()

    async def pump(self, write: Write, drained: Callable[[], Awaitable[None]]) -> None:
        """Hand every body chunk to ``write`` as it arrives (within the connection's
        ``data_received``); return at the end of the body. ``write`` returning True pauses
        reading until ``drained()`` returns. Raises UpstreamBroken."""
        conn = self._conn
        if conn.chunks:
            write(conn.take())
        conn.sink, conn.drained = write, drained
        try:
            while conn.error is None and not conn.complete:
                await conn.wait()
        finally:
            conn.sink = conn.drained = None
        if conn.error is not None:
            raise conn.error

    async def aclose(self, reuse: bool) -> None:
        conn = self._conn
        if reuse and conn.complete and conn.keep and not conn.closed:
            if conn.resume is not None:
                conn.resume.cancel()
            if conn.paused:
                conn.paused = False
                conn.transport.resume_reading()  # type: ignore[union-attr]
            conn.origin.release(conn)
        else:
            conn.abort()


class HttptoolsUpstream:
    def __init__(self, settings: UpstreamSection) -> None:
        self.connect_timeout = settings.connect_timeout
        self.limit = settings.max_connections
        self._per_backend = settings.max_connections_per_backend or settings.max_connections
        self.open = 0
        self._origins: dict[tuple[str, int, bool], _Origin] = {}
        # url -> (origin, request line and Host header): backend base + a few fixed paths.
        self._targets: dict[str, tuple[_Origin, bytes]] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def _target(self, method: str, url: str) -> tuple[_Origin, bytes]:
        key = method + " " + url
        found = self._targets.get(key)
        if found is None:
            parts = urlsplit(url)
            secure = parts.scheme == "https"
            host = parts.hostname or "localhost"
            port = parts.port or (443 if secure else 80)
            origin = self._origins.get((host, port, secure))
            if origin is None:
                if secure and self._tls is None:
                    self._tls = ssl.create_default_context()
                origin = self._origins[(host, port, secure)] = _Origin(
                    self, host, port, self._tls if secure else None, self._per_backend)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            line = f"{method} {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1")
            found = self._targets[key] = (origin, line)
        return found

    async def request(self, method: str, url: str, headers: Headers,
                      body: bytes) -> HttptoolsResponse:
        origin, line = self._target(method, url)
        parts = [line]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % len(body))
        head = b"".join(parts)
        while True:
            conn = await origin.acquire()
            conn.send(head, body)
            try:
                while not conn.head and conn.error is None:
                    await conn.wait()
            except BaseException:
                conn.abort()
                raise
            if conn.error is None:
                return HttptoolsResponse(conn)
            conn.abort()
            # A kept-alive connection that died unanswered: the backend closed it while it
            # was idle. Once more on another (a fresh connection's failure is final).
            if not conn.reused or conn.received:
                raise conn.error

    def sweep_soon(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(KEEPALIVE / 4, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for origin in self._origins.values():
            origin.sweep(now)
        if any(origin.idle for origin in self._origins.values()):
            self.sweep_soon()

    def wake_any(self) -> None:
        for origin in self._origins.values():
            if origin._wake():
                return

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for origin in self._origins.values():
            for conn in list(origin.idle):
                conn.abort()
