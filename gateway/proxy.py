"""The request path: parse once, choose a backend, forward, relay bytes as they come."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from backends.asgi import BodyTooLarge, Receive, Scope, Send, cancel_on_disconnect, read_body
from backends.backend import Backend
from gateway.canary.arms import Arms
from gateway.canary.rollout import Canary
from gateway.canary.shadow import Shadow
from gateway.canary.tally import Tally
from gateway.config import Config
from gateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    StreamAborted,
    UpstreamTimeout,
    UpstreamUnavailable,
    sse_error_event,
)
from gateway.http.asgi import request_id, send_error
from gateway.http.deadline import Deadline
from gateway.http.headers import client_response_headers, upstream_request_headers
from gateway.http.rewrite import ModelRewrite
from gateway.metrics import Metrics
from gateway.observability.access_log import RequestLog
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.degraded import Degraded
from gateway.resilience.retry import RETRIABLE, RetryBudget, backoff, retry_after
from gateway.routing.pool import BackendPool
from gateway.routing.router import Router
from gateway.types import RequestContext
from gateway.upstream import ConnectFailed, Upstream, UpstreamBroken, UpstreamResponse

log = logging.getLogger("gateway.proxy")

# How vLLM reports a failure inside an HTTP 200 stream. A JSON string can't hold this
# byte sequence unescaped, so a token can never look like it.
INBAND_ERROR = b'data: {"error"'
INBAND = len(INBAND_ERROR)


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    """A header's value (``name`` in lower case), or b"" when absent."""
    return next((v for k, v in headers if k.lower() == name), b"")



class Proxy:
    """The ASGI endpoint behind every OpenAI POST route."""

    def __init__(
        self, config: Config, pool: BackendPool, upstream: Upstream, router: Router,
        degraded: Degraded, metrics: Metrics, canary: Canary, arms: Arms,
    ) -> None:
        self._pool = pool
        self._canary = canary
        self._arms = arms
        self._tally = Tally(metrics, canary)
        self._log = RequestLog(metrics, config.gateway.access_log)
        self._shadow = Shadow(upstream, router, pool, canary, metrics,
                              config.upstream.total_timeout)
        self._degraded = degraded
        self._replies = degraded.cache
        self._cache_max = config.degraded.cache_max_bytes
        self._metrics = metrics
        self._upstream = upstream
        self._router = router
        self._budget = RetryBudget(config.upstream.retry_budget_ratio,
                                   config.upstream.retry_budget_floor)
        self._max_session_key = config.routing.session_key_max_len
        self._max_body = config.gateway.max_body_bytes
        self._body_timeout = config.gateway.body_timeout
        self._timeouts = config.upstream
        # (header name, None) or (None, body field), in the configured order
        self._session_sources: list[tuple[bytes | None, str | None]] = [
            (name.encode(), None) if kind == "header" else (None, name)
            for kind, _, name in (s.partition(":") for s in config.routing.session_keys)
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = request_id(scope)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        deadline = Deadline(begun + self._body_timeout)
        try:
            body = await read_body(receive, self._max_body)
        except BodyTooLarge:
            deadline.cancel()
            await send_error(send, PayloadTooLarge(
                f"request body exceeds {self._max_body} bytes"), rid)
            self._log.rejected(rid, scope["path"], 413, loop.time() - begun)
            return
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            await send_error(send, RequestTimeout(
                f"request body not received within {self._body_timeout:g} s"), rid)
            self._log.rejected(rid, scope["path"], 408, loop.time() - begun)
            return
        if body is None:
            deadline.cancel()
            return
        task = asyncio.current_task()
        assert task is not None
        watcher = cancel_on_disconnect(receive)
        ctx = None
        try:
            ctx = self._context(scope, body, rid)
            ctx.started = begun
            await self._serve(ctx, send, deadline)
        except GatewayError as exc:
            await send_error(send, exc, rid)
            if ctx is None:
                self._log.rejected(rid, scope["path"], exc.status, loop.time() - begun)
            else:
                ctx.status = exc.status
        except asyncio.CancelledError:
            if watcher.done() and task.uncancel() == 0:
                log.info("request %s: client disconnected, upstream cancelled", rid)
                if ctx is not None:
                    ctx.note = "client gone"
                    if ctx.shadow is not None:
                        ctx.shadow.cancel()  # the mirror goes with the client
                return
            raise
        finally:
            watcher.cancel()
            deadline.cancel()
            if ctx is not None:
                self._log.done(ctx, loop.time())

    def _context(self, scope: Scope, body: bytes, rid: str) -> RequestContext:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("request body must be a JSON object")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required and must be a non-empty string")
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        return RequestContext(
            request_id=rid,
            path=scope["path"],
            model=model,
            stream=payload.get("stream") is True,
            session_key=self._session_key(headers, payload),
            body=body,
            headers=headers,
            payload=payload,
        )

    def _session_key(
        self, headers: list[tuple[bytes, bytes]], payload: dict[str, object]
    ) -> str | None:
        for header, field in self._session_sources:
            value: object = None
            if header is not None:
                value = next((v.decode("latin-1") for k, v in headers if k == header), None)
            elif field is not None:
                value = payload.get(field)
            if isinstance(value, str) and value:
                if len(value) > self._max_session_key:
                    raise BadRequest(
                        f"session key is longer than {self._max_session_key} characters")
                return value
        return None

    async def _serve(self, ctx: RequestContext, send: Send, deadline: Deadline) -> None:
        loop = asyncio.get_running_loop()
        total = loop.time() + self._timeouts.total_timeout
        self._budget.deposit()
        if self._canary.enabled:
            await self._arms.assign(ctx)
            if ctx.group == self._canary.stable and self._canary.shadow():
                ctx.shadow = self._shadow.mirror(ctx)
        tried: list[Backend] = []
        failure: GatewayError | None = None
        for attempt in range(1, self._timeouts.max_attempts + 1):
            ticket = await self._router.choose(ctx, tried)
            if ticket is None:
                break
            backend = ticket.backend
            if attempt > 1:
                pause = backoff(attempt - 1, self._timeouts.retry_backoff)
                if loop.time() + pause >= total:
                    break
                await asyncio.sleep(pause)
            tried.append(backend)
            backend.in_flight += 1
            try:
                deadline.until(min(total, loop.time() + self._timeouts.first_byte_timeout))
                try:
                    resp = await self._open(backend, ctx, deadline)
                except (UpstreamTimeout, UpstreamUnavailable) as exc:
                    ticket.done(Outcome.FAILURE, exc.message)
                    failure = exc
                    break
                if resp is None:
                    ticket.done(Outcome.FAILURE, "connect")
                    if self._may_retry(ctx, tried, attempt, "connect"):
                        continue
                    break
                ticket.status = resp.status
                if resp.status >= 500 or resp.status == 429:
                    busy = self._note_busy(resp, backend)
                    ticket.done(Outcome.NEUTRAL if busy or resp.status == 429
                                else Outcome.FAILURE, f"status {resp.status}")
                    if resp.status in RETRIABLE and self._may_retry(ctx, tried, attempt,
                                                                     str(resp.status)):
                        log.info("request %s: backend %s answered %d, retrying elsewhere",
                                 ctx.request_id, backend.name, resp.status)
                        await resp.aclose(reuse=False)
                        continue
                    if resp.status >= 500 and (found := await self._degraded.find(ctx)):
                        await resp.aclose(reuse=False)
                        await self._degraded.send(ctx, send, found,
                                                  f"backend {backend.name} answered "
                                                  f"{resp.status}")
                        return
                deadline.stream(self._timeouts.idle_timeout, total)
                await self._relay(resp, ticket, ctx, send, deadline, loop)
                return
            finally:
                backend.in_flight -= 1
                ticket.done(Outcome.NEUTRAL)  # no-op once an outcome was given
                self._tally.attempt(ticket, ctx.started)
        if not tried and not self._pool.known_model(ctx.model):
            raise ModelNotFound(f"The model `{ctx.model}` does not exist.")
        why = (failure.message if failure else
               f"no backend for model {ctx.model!r} could be reached" if tried else
               f"no healthy backend serves model {ctx.model!r}")
        found = await self._degraded.find(ctx)
        if found is not None:
            await self._degraded.send(ctx, send, found, why)
        elif failure is not None:
            raise failure
        else:
            await self._degraded.unavailable(ctx, send, why)

    def _may_retry(self, ctx: RequestContext, tried: list[Backend], attempt: int,
                   reason: str) -> bool:
        """Commit to another attempt: one is left, another backend could take it, and the
        budget pays for it. Nothing reached the client yet, so a retry is invisible."""
        if attempt >= self._timeouts.max_attempts or not self._router.can_retry(ctx, tried):
            return False
        if not self._budget.withdraw():
            self._metrics.retry_budget_exhausted.inc()
            return False
        self._metrics.retries.labels(reason).inc()
        return True

    @staticmethod
    def _note_busy(resp: UpstreamResponse, backend: Backend) -> bool:
        """A 429/503 with Retry-After: busy, not broken. Skip the backend that long."""
        if resp.status not in (429, 503):
            return False
        seconds = retry_after(header(resp.headers, b"retry-after") or None)
        if not seconds:
            return False
        backend.busy_until = time.monotonic() + seconds
        log.warning("backend %s busy: skipped for %.1f s (Retry-After)", backend.name, seconds)
        return True

    async def _open(
        self, backend: Backend, ctx: RequestContext, deadline: Deadline
    ) -> UpstreamResponse | None:
        """Send the request; None when no connection could be made (try another backend)."""
        headers = upstream_request_headers(ctx.headers, backend, ctx.request_id)
        body = self._pool.names.body_for(ctx, backend.spec.group)
        try:
            return await self._upstream.request("POST", backend.url + ctx.path, headers, body)
        except ConnectFailed as exc:
            log.warning("request %s: backend %s unreachable: %s", ctx.request_id, backend.name,
                        exc)
            return None
        except UpstreamBroken as exc:
            raise UpstreamUnavailable(f"backend {backend.name} failed: {exc}") from None
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            raise UpstreamTimeout(
                f"backend {backend.name} sent no response headers in time") from None

    def _rewrite(self, ctx: RequestContext, backend: Backend,
                 headers: list[tuple[bytes, bytes]]) -> ModelRewrite | None:
        """How the reply must change to name the client's model, or None (bytes pass as
        they are). An encoded body can't be rewritten; vLLM never encodes its replies."""
        served = self._pool.names.served(ctx.model, backend.spec.group)
        if served == ctx.model or header(headers, b"content-encoding") not in (b"", b"identity"):
            return None
        return ModelRewrite(served, ctx.model)

    async def _relay(
        self, resp: UpstreamResponse, ticket: Ticket, ctx: RequestContext, send: Send,
        deadline: Deadline, loop: asyncio.AbstractEventLoop,
    ) -> None:
        backend = ticket.backend
        ctx.served_by, ctx.status = backend, resp.status
        stream = header(resp.headers, b"content-type").startswith(b"text/event-stream")
        rewrite = self._rewrite(ctx, backend, resp.headers)
        if rewrite is not None and not stream:
            await self._relay_whole(resp, ticket, ctx, send, deadline, loop, rewrite)
            return
        await send({
            "type": "http.response.start",
            "status": resp.status,
            "headers": client_response_headers(resp.headers, backend, ctx.request_id, stream),
        })
        # Kept for the reply cache: the chunks relayed anyway, by reference, up to the cap.
        parts: list[bytes] | None = [] if resp.status == 200 and self._replies.wants(ctx) \
            else None
        room = self._cache_max
        cause = None
        reuse = False
        chunks = 0
        tail = b""  # the end of a line split across chunks, for the in-band check
        try:
            chunk = await resp.read()
            ctx.first_byte = ticket.first_byte = loop.time()
            while chunk:
                if rewrite is not None:
                    chunk = rewrite.feed(chunk)
                    if not chunk:  # half a line: it goes out with the rest of it
                        chunk = await resp.read()
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                deadline.touch()
                chunks += 1
                if stream and cause is None:
                    if INBAND_ERROR in chunk or (tail and INBAND_ERROR in tail + chunk[:INBAND]):
                        cause = "inband"
                    tail = b"" if chunk.endswith(b"\n") else (tail + chunk)[-INBAND:]
                if parts is not None:
                    parts.append(chunk)
                    room -= len(chunk)
                    if room < 0:
                        parts = None
                chunk = await resp.read()
            if rewrite is not None and (rest := rewrite.flush()):
                await send({"type": "http.response.body", "body": rest, "more_body": True})
                if parts is not None:
                    parts.append(rest)
            reuse = True
        except UpstreamBroken as exc:
            cause, detail = "dropped", "failed"
            log.warning("request %s: backend %s: %s", ctx.request_id, backend.name, exc)
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            cause, detail = "stalled", "stalled"
        finally:
            ctx.chunks, ctx.last_byte = chunks, deadline.last
            await resp.aclose(reuse)
        if cause is not None:
            ctx.note = f"stream {cause}"
        if cause is None:
            ticket.done(Outcome.SUCCESS if resp.status < 400 else Outcome.NEUTRAL)
            if parts is not None:
                self._replies.keep(ctx, parts, stream)
        else:
            ticket.done(Outcome.FAILURE, cause)
            self._metrics.stream_failures.labels(cause).inc()
        if cause in ("dropped", "stalled"):
            log.warning("request %s: backend %s %s mid-response", ctx.request_id,
                        backend.name, detail)
            if not stream:
                raise StreamAborted(detail)
            event = sse_error_event(f"backend {backend.name} {detail} mid-stream",
                                    "upstream_error", 502)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_whole(
        self, resp: UpstreamResponse, ticket: Ticket, ctx: RequestContext, send: Send,
        deadline: Deadline, loop: asyncio.AbstractEventLoop, rewrite: ModelRewrite,
    ) -> None:
        """A non-streaming reply whose body changes: read it whole, rewrite it, and send it
        with its new ``Content-Length``. Nothing went out yet when the backend breaks, so
        the client gets a clean 502 or 504 instead of a cut body."""
        backend = ticket.backend
        parts: list[bytes] = []
        reuse = False
        try:
            chunk = await resp.read()
            ctx.first_byte = ticket.first_byte = loop.time()
            while chunk:
                parts.append(chunk)
                deadline.touch()
                chunk = await resp.read()
            reuse = True
        except UpstreamBroken as exc:
            log.warning("request %s: backend %s failed mid-reply: %s", ctx.request_id,
                        backend.name, exc)
            self._fail_reply(ticket, ctx, "dropped")
            raise UpstreamUnavailable(f"backend {backend.name} failed mid-reply") from None
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            self._fail_reply(ticket, ctx, "stalled")
            raise UpstreamTimeout(f"backend {backend.name} stalled mid-reply") from None
        finally:
            await resp.aclose(reuse)
        body = rewrite.whole(parts[0] if len(parts) == 1 else b"".join(parts))
        await send({
            "type": "http.response.start",
            "status": resp.status,
            "headers": client_response_headers(resp.headers, backend, ctx.request_id, False,
                                               len(body)),
        })
        await send({"type": "http.response.body", "body": body, "more_body": False})
        ctx.chunks, ctx.last_byte = 1, loop.time()
        ticket.done(Outcome.SUCCESS if resp.status < 400 else Outcome.NEUTRAL)
        if resp.status == 200 and len(body) <= self._cache_max and self._replies.wants(ctx):
            self._replies.keep(ctx, [body], False)

    def _fail_reply(self, ticket: Ticket, ctx: RequestContext, cause: str) -> None:
        ctx.note = f"stream {cause}"
        ticket.done(Outcome.FAILURE, cause)
        self._metrics.stream_failures.labels(cause).inc()
