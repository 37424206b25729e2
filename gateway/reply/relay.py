"""The relay: a backend's reply sent on to the client as it comes, chunk by chunk.

Each chunk is sent, the deadline stamped, an in-band error looked for, and the chunk kept by
reference for the reply cache (``Tap``). A stream from the httptools client to uvicorn's own
``send`` takes the fast path: the client's connection is written inside the backend
connection's ``data_received`` (``gateway.http.sink``), with no task switch per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from starlette.types import Send

from backends.backend import Backend
from gateway.errors import StreamAborted, UpstreamTimeout, UpstreamUnavailable, sse_error_event
from gateway.http.deadline import Deadline
from gateway.http.headers import client_response_headers, header
from gateway.http.rewrite import Chain, Filter, ModelRewrite
from gateway.http.sink import Sink
from gateway.metrics import Metrics
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.replies import ReplyCache
from gateway.routing.pool import BackendPool
from gateway.tenants.usage import UsageStrip, cached_of, usage_of
from gateway.types import Record, Request, StreamCause
from gateway.upstream import UpstreamBroken, UpstreamResponse

log = logging.getLogger("gateway.proxy")

# How vLLM reports a failure inside an HTTP 200 stream. A JSON string can't hold this
# byte sequence unescaped, so a token can never look like it.
INBAND_ERROR = b'data: {"error"'
INBAND = len(INBAND_ERROR)


FALLBACK = (b"x-gateway-degraded", b"fallback")


def _headers(resp: UpstreamResponse, backend: Backend, record: Record, stream: bool,
             length: int | None = None, explain: bool = False) -> list[tuple[bytes, bytes]]:
    """The reply's headers for the client; a fallback model's reply says it is one."""
    headers = client_response_headers(resp.headers, backend, record.request.request_id,
                                      stream, length)
    if record.fallback_of is not None:
        headers.append(FALLBACK)
    cached = record.request.cached
    if explain and cached is not None:  # the prompt tokens it was predicted to hold
        headers.append((b"x-gateway-cached-tokens", b"%d" % cached.get(backend.name, 0)))
        headers.append((b"x-gateway-kv-rule", cached.rule.encode()))
    return headers


def _counted(record: Record, tail: bytes, rewrite: Filter | None) -> None:
    """The usage (what a filter took out of the stream, else the reply's ``tail``) and,
    when the kv policy predicted it, the cached tokens vLLM reports."""
    record.usage = (rewrite.usage if rewrite is not None else None) or usage_of(tail)
    if record.request.cached is not None:
        record.cached = cached_of(tail)


class Tap:
    """What happens to each relayed chunk besides its sending: the deadline stamped, an
    in-band error looked for, the chunk kept by reference for the reply cache (up to the
    cap). Allocates nothing of its own per chunk."""

    __slots__ = ("_deadline", "_loop", "_record", "_room", "_stream", "_tail", "_ticket",
                 "before", "cause", "chunks", "last", "parts")

    def __init__(self, ticket: Ticket, record: Record, deadline: Deadline, stream: bool,
                 parts: list[bytes] | None, room: int) -> None:
        self._ticket, self._record, self._deadline = ticket, record, deadline
        self._loop = asyncio.get_running_loop()
        self._stream, self.parts, self._room = stream, parts, room
        self._tail = b""  # the end of a line split across chunks, for the in-band check
        self.cause: StreamCause | None = None
        self.chunks = 0
        self.before = self.last = b""  # the last two chunks, where the usage is

    def __call__(self, chunk: bytes) -> None:
        now = self._deadline.last = self._loop.time()
        if not self.chunks:
            self._ticket.first_byte = now
            if self._record.first_byte is None:  # a continuation's is not the request's
                self._record.first_byte = now
            if self._record.prediction is not None:  # the prefill is over
                self._record.prediction.began(now, self._stream)
        self.chunks += 1
        self.before, self.last = self.last, chunk
        if self._stream and self.cause is None:
            tail = self._tail
            if INBAND_ERROR in chunk or (tail and INBAND_ERROR in tail + chunk[:INBAND]):
                self.cause = StreamCause.INBAND
            self._tail = b"" if chunk.endswith(b"\n") else (tail + chunk)[-INBAND:]
        if self.parts is not None:
            self.parts.append(chunk)
            self._room -= len(chunk)
            if self._room < 0:
                self.parts = None


class Resumer(Protocol):
    """Continues a broken stream elsewhere (``gateway.reply.resume.Resume``)."""

    room: int  # bytes of a stream kept to continue it

    def wants(self, request: Request) -> bool: ...

    async def __call__(self, record: Record, parts: list[bytes], failed: Ticket, send: Send,
                       deadline: Deadline) -> bool: ...


class Relay:
    """Sends one attempt's reply to the client and tells the ticket how the relay ended."""

    def __init__(self, pool: BackendPool, replies: ReplyCache, cache_max: int,
                 metrics: Metrics) -> None:
        self._pool = pool  # asked for the model map each time: a reload replaces it
        self._replies = replies
        self._cache_max = cache_max
        self._metrics = metrics
        self.resume: Resumer | None = None  # continues broken streams (gateway.reply.resume)
        # routing.kv_header: each reply says the prompt tokens its backend was predicted to
        # hold. Off by default: with one cache for several tenants it tells one of them
        # what the others sent recently.
        self.explain = False

    def _rewrite(self, request: Request, backend: Backend,
                 headers: list[tuple[bytes, bytes]]) -> ModelRewrite | None:
        """How the reply must change to name the client's model, or None (bytes pass as
        they are). An encoded body can't be rewritten; vLLM never encodes its replies."""
        served = self._pool.names.served(request.model, backend.spec.group)
        if served == request.model or header(headers, b"content-encoding") not in (
                b"", b"identity"):
            return None
        return ModelRewrite(served, request.model)

    async def __call__(self, resp: UpstreamResponse, ticket: Ticket, outcome: Outcome,
                       record: Record, send: Send, deadline: Deadline) -> None:
        """Relay ``resp``; ``outcome`` is told if it ends cleanly, FAILURE if it breaks."""
        request, backend = record.request, ticket.backend
        record.served_by, record.status = backend, resp.status
        stream = header(resp.headers, b"content-type").startswith(b"text/event-stream")
        rewrite: Filter | None = self._rewrite(request, backend, resp.headers)
        if request.strip_usage and stream and resp.status == 200:
            strip = UsageStrip()
            rewrite = strip if rewrite is None else Chain(rewrite, strip)
        if rewrite is not None and not stream:
            await self._whole(resp, ticket, outcome, record, send, deadline, rewrite)
            return
        await send({
            "type": "http.response.start",
            "status": resp.status,
            "headers": _headers(resp, backend, record, stream, explain=self.explain),
        })
        # Kept for the reply cache, and to continue the stream should it break: the chunks
        # relayed anyway, by reference, up to the cap.
        resume = self.resume if stream and resp.status == 200 else None
        resumable = resume is not None and resume.wants(request)
        cached = resp.status == 200 and self._replies.wants(request)
        parts: list[bytes] | None = [] if cached or resumable else None
        room = max(resume.room, self._cache_max) if resume and resumable else self._cache_max
        cause, parts, tail = await self._chunks(resp, ticket, record, send, deadline, rewrite,
                                                stream, parts, room)
        if cause is None:
            # What a filter took out of the stream, else the tail the client got.
            _counted(record, tail, rewrite)
            if parts is not None and (not cached or (
                    resumable and sum(map(len, parts)) > self._cache_max)):
                parts = None  # kept to continue, not to cache
        elif resumable and parts is not None and cause is not StreamCause.INBAND:
            assert resume is not None
            self._fail(ticket, record, cause)
            if await resume(record, parts, ticket, send, deadline):
                return
            cause = StreamCause.RESUMED  # the error event, the failure already told
        await self._end(ticket, outcome, record, send, cause, parts, stream)

    async def _chunks(
        self, resp: UpstreamResponse, ticket: Ticket, record: Record, send: Send,
        deadline: Deadline, rewrite: Filter | None, stream: bool,
        parts: list[bytes] | None, room: int,
    ) -> tuple[StreamCause | None, list[bytes] | None, bytes]:
        """The per-chunk loop: why it ended early (None: the reply ended), the parts kept
        (None once over ``room`` bytes), and the reply's tail (its last chunks)."""
        tap = Tap(ticket, record, deadline, stream, parts, room)
        reuse = False
        try:
            pump = getattr(resp, "pump", None)
            sink = Sink.of(send) if pump is not None and rewrite is None else None
            if sink is not None:
                await pump(sink.relay(tap), sink.drained)  # type: ignore[misc]
            else:
                await self._loop(resp, send, tap, rewrite)
            reuse = True
        except UpstreamBroken as exc:
            tap.cause = StreamCause.DROPPED
            log.warning("request %s: backend %s: %s", record.request.request_id,
                        ticket.backend.name, exc)
        except asyncio.CancelledError:
            if not deadline.absorb():
                # The client went away, perhaps as soon as it read the last event (an SDK
                # closes at `[DONE]`, before the reply's own end): what it was sent counts.
                _counted(record, tap.before + tap.last, rewrite)
                raise
            tap.cause = StreamCause.STALLED
        finally:
            record.chunks, record.last_byte = record.chunks + tap.chunks, deadline.last
            await resp.aclose(reuse)
        return tap.cause, tap.parts, tap.before + tap.last

    async def resumed(self, resp: UpstreamResponse, ticket: Ticket, record: Record, send: Send,
                      deadline: Deadline, seam: Filter, parts: list[bytes], room: int,
                      ) -> tuple[bool, list[bytes] | None]:
        """A continuation's chunks relayed through ``seam`` into the client's stream: whether
        it ended the stream, and the parts kept (the client's whole stream so far)."""
        record.served_by = ticket.backend
        cause, kept, _ = await self._chunks(resp, ticket, record, send, deadline, seam, True,
                                            parts, room)
        if cause is not None:
            self._fail(ticket, record, cause)
            return False, kept
        ticket.done(Outcome.SUCCESS)
        record.usage = seam.usage or record.usage
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True, kept

    @staticmethod
    async def _loop(resp: UpstreamResponse, send: Send, tap: Tap,
                    rewrite: Filter | None) -> None:
        """Chunk by chunk through ``send`` (a wrapped ``send``, a rewrite, another client)."""
        chunk = await resp.read()
        while chunk:
            if rewrite is not None:
                chunk = rewrite.feed(chunk)
                if not chunk:  # half a line: it goes out with the rest of it
                    chunk = await resp.read()
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tap(chunk)
            chunk = await resp.read()
        if rewrite is not None and (rest := rewrite.flush()):
            await send({"type": "http.response.body", "body": rest, "more_body": True})
            tap(rest)

    async def _end(self, ticket: Ticket, outcome: Outcome, record: Record, send: Send,
                   cause: StreamCause | None, parts: list[bytes] | None, stream: bool) -> None:
        """The tail of a relay: the outcome, the reply kept, and the client told of a stream
        cut short (a non-streaming reply can only be cut: its length was promised)."""
        if cause is None:
            ticket.done(outcome)
            if parts is not None:
                self._replies.keep(record.request, parts, stream)
        elif cause is not StreamCause.RESUMED:
            self._fail(ticket, record, cause)
        if cause in (StreamCause.DROPPED, StreamCause.STALLED, StreamCause.RESUMED):
            detail = "stalled" if cause is StreamCause.STALLED else "failed"
            name = ticket.backend.name
            log.warning("request %s: backend %s %s mid-response", record.request.request_id, name,
                        detail)
            if not stream:
                raise StreamAborted(detail)
            event = sse_error_event(f"backend {name} {detail} mid-stream", "upstream_error", 502)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _whole(
        self, resp: UpstreamResponse, ticket: Ticket, outcome: Outcome, record: Record,
        send: Send, deadline: Deadline, rewrite: Filter,
    ) -> None:
        """A non-streaming reply whose body changes: read it whole, rewrite it, and send it
        with its new ``Content-Length``. Nothing went out yet when the backend breaks, so
        the client gets a clean 502 or 504 instead of a cut body."""
        loop = asyncio.get_running_loop()
        request, backend = record.request, ticket.backend
        parts: list[bytes] = []
        reuse = False
        try:
            chunk = await resp.read()
            record.first_byte = ticket.first_byte = loop.time()
            while chunk:
                parts.append(chunk)
                deadline.touch()
                chunk = await resp.read()
            reuse = True
        except UpstreamBroken as exc:
            log.warning("request %s: backend %s failed mid-reply: %s", request.request_id,
                        backend.name, exc)
            self._fail(ticket, record, StreamCause.DROPPED)
            raise UpstreamUnavailable(f"backend {backend.name} failed mid-reply") from None
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            self._fail(ticket, record, StreamCause.STALLED)
            raise UpstreamTimeout(f"backend {backend.name} stalled mid-reply") from None
        finally:
            await resp.aclose(reuse)
        body = rewrite.whole(parts[0] if len(parts) == 1 else b"".join(parts))
        _counted(record, body[-4096:], None)
        await send({
            "type": "http.response.start",
            "status": resp.status,
            "headers": _headers(resp, backend, record, False, len(body), self.explain),
        })
        await send({"type": "http.response.body", "body": body, "more_body": False})
        record.chunks, record.last_byte = 1, loop.time()
        ticket.done(outcome)
        if resp.status == 200 and len(body) <= self._cache_max and self._replies.wants(request):
            self._replies.keep(request, [body], False)

    def _fail(self, ticket: Ticket, record: Record, cause: StreamCause) -> None:
        record.note = f"stream {cause}"
        ticket.done(Outcome.FAILURE, cause)
        self._metrics.stream_failures.labels(cause).inc()
