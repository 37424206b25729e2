"""What a client gets when no backend can answer: an earlier reply, a static one, or 503."""

from __future__ import annotations

import logging
import time
from collections import deque

from starlette.types import Send

from gateway.config import DegradedSection
from gateway.errors import NoBackend
from gateway.http.asgi import JSON, send_json
from gateway.http.headers import STREAM_HEADERS
from gateway.metrics import Metrics
from gateway.resilience.replies import ReplyCache
from gateway.resilience.sse import CHAT, unfold
from gateway.resilience.sse import static_reply as static_body
from gateway.types import RequestContext

log = logging.getLogger("gateway.degraded")

SSE = (b"content-type", b"text/event-stream; charset=utf-8")


class Degraded:
    def __init__(self, settings: DegradedSection, cache: ReplyCache, metrics: Metrics) -> None:
        self._settings = settings
        self.cache = cache
        self._counter = metrics.degraded
        self.recent: deque[dict[str, object]] = deque(maxlen=20)  # for the status page

    async def find(self, ctx: RequestContext) -> tuple[bytes, str] | None:
        """The best answer without a backend: (completion body, "cache" | "static")."""
        body = await self.cache.lookup(ctx)
        if body is not None:
            return body, "cache"
        message = self._settings.static_message
        if message is not None and ctx.path in (CHAT, "/v1/completions"):
            return static_body(ctx.path, ctx.model, message, ctx.request_id), "static"
        return None

    async def send(self, ctx: RequestContext, send: Send, found: tuple[bytes, str],
                   why: str) -> None:
        body, kind = found
        self._counter.labels(kind).inc()
        ctx.status, ctx.note = 200, f"degraded {kind}"
        self._remember(ctx, kind, why)
        log.warning("request %s: degraded reply (%s): %s", ctx.request_id, kind, why)
        headers = [(b"x-request-id", ctx.request_id.encode()),
                   (b"x-gateway-degraded", kind.encode())]
        if ctx.stream and ctx.path != "/v1/embeddings":
            options = ctx.payload.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            body = unfold(ctx.path, body, include_usage)
            headers += [SSE, *STREAM_HEADERS]
        else:
            headers.append(JSON)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _remember(self, ctx: RequestContext, kind: str, why: str) -> None:
        self.recent.appendleft({"at": time.time(), "id": ctx.request_id, "model": ctx.model,
                                "kind": kind, "why": why})

    async def unavailable(self, ctx: RequestContext, send: Send, why: str) -> None:
        """Nothing to answer with: 503 and when to come back."""
        self._counter.labels("unavailable").inc()
        error = NoBackend(why)
        ctx.status, ctx.note = error.status, "unavailable"
        self._remember(ctx, "unavailable", why)
        await send_json(send, error.status, error.body(), ctx.request_id,
                        [(b"retry-after", str(self._settings.retry_after).encode())])
