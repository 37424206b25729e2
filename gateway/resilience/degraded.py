"""What a client gets when no backend can answer: an earlier reply, a static one, or 503."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import orjson
from starlette.types import Send

from gateway.config import DegradedSection
from gateway.errors import NoBackend
from gateway.http.asgi import JSON, send_json
from gateway.http.headers import STREAM_HEADERS
from gateway.metrics import Metrics
from gateway.resilience.replies import ReplyCache
from gateway.resilience.sse import CHAT, unfold
from gateway.resilience.sse import static_reply as static_body
from gateway.types import Record, Request

log = logging.getLogger("gateway.degraded")

SSE = (b"content-type", b"text/event-stream; charset=utf-8")
# The routes a smaller model may answer instead (``[[models]] fallback``).
GENERATIONS = frozenset((CHAT, "/v1/completions", "/v1/responses", "/v1/messages"))


@dataclass(frozen=True, slots=True)
class Fallback:
    """An answer found without a backend: a completion body, and where it came from."""

    body: bytes
    kind: str  # "cache" | "static"


class Degraded:
    def __init__(self, settings: DegradedSection, cache: ReplyCache, metrics: Metrics) -> None:
        self._settings = settings
        self.cache = cache
        self._counter = metrics.degraded
        self.recent: deque[dict[str, object]] = deque(maxlen=20)  # for the status page

    async def find(self, request: Request, cache: bool = True,
                   static: bool = True) -> Fallback | None:
        """The best answer without a backend: a reply kept earlier, else the static one."""
        body = await self.cache.lookup(request) if cache else None
        if body is not None:
            return Fallback(body, "cache")
        message = self._settings.static_message
        if static and message is not None and request.path in (CHAT, "/v1/completions"):
            return Fallback(static_body(request.path, request.model, message,
                                        request.request_id), "static")
        return None

    async def send(self, record: Record, send: Send, found: Fallback, why: str) -> None:
        request, body, kind = record.request, found.body, found.kind
        self._counter.labels(kind).inc()
        record.status, record.note = 200, f"degraded {kind}"
        self._remember(request, kind, why)
        log.warning("request %s: degraded reply (%s): %s", request.request_id, kind, why)
        headers = [(b"x-request-id", request.request_id.encode()),
                   (b"x-gateway-degraded", kind.encode())]
        if request.stream and request.path != "/v1/embeddings":
            options = request.payload.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            body = unfold(request.path, body, include_usage)
            headers += [SSE, *STREAM_HEADERS]
        else:
            headers.append(JSON)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def smaller(record: Record, name: str | None) -> Request | None:
        """The request for ``name``, the model's fallback, when its key may use it and no
        fallback was tried already. Only a generation (chat, completions, responses,
        messages) that names no stored response: another model's embeddings, scores or
        transcripts are not a degraded answer, and a stored response lives on one backend."""
        request = record.request
        if name is None or record.fallback_of or request.follows or (
                request.path not in GENERATIONS) or (
                record.allowed is not None and name not in record.allowed):
            return None
        payload = {**request.payload, "model": name}
        return replace(request, model=name, payload=payload, body=orjson.dumps(payload))

    def fallback(self, record: Record, smaller: Request, why: str) -> None:
        """The request goes to its model's fallback (``[[models]] fallback``) instead."""
        asked = record.request.model
        self._counter.labels("fallback").inc()
        self._remember(record.request, "fallback", why)
        log.warning("request %s: model %s answered by its fallback %s: %s",
                    smaller.request_id, asked, smaller.model, why)
        record.request, record.fallback_of = smaller, asked
        record.note, record.group = f"degraded fallback from {asked}", None

    def _remember(self, request: Request, kind: str, why: str) -> None:
        self.recent.appendleft({"at": time.time(), "id": request.request_id,
                                "model": request.model, "kind": kind, "why": why})

    async def unavailable(self, record: Record, send: Send, why: str) -> None:
        """Nothing to answer with: 503 and when to come back."""
        self._counter.labels("unavailable").inc()
        error = NoBackend(why)
        record.status, record.note = error.status, "unavailable"
        self._remember(record.request, "unavailable", why)
        await send_json(send, error.status, error.body(), record.request.request_id,
                        [(b"retry-after", str(self._settings.retry_after).encode())])
