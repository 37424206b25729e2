"""Accounting of client requests: one record per request (metrics and one structured
access-log line), written when it ends."""

from __future__ import annotations

import logging
from typing import Any

from gateway.metrics import Children, Metrics
from gateway.observability.logs import JsonLines
from gateway.observability.tracing import Tracing
from gateway.types import BATCH_BAND, Record

log = logging.getLogger("gateway.access")
AGENT_CHARS = 256  # of a client's User-Agent in its line


def user_agent(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's User-Agent, cut to AGENT_CHARS (read once, when its line is written;
    the formatters escape what could break a line)."""
    for name, value in headers:
        if name == b"user-agent":
            return value[:AGENT_CHARS].decode("latin-1")
    return None


class RequestLog:
    def __init__(self, metrics: Metrics, access_log: bool,
                 tracing: Tracing | None = None) -> None:
        self._m = metrics
        self._tracing = tracing
        self._log = access_log
        self._json: JsonLines | None = None
        self._checked = False
        self._child = Children()

    def _line(self, fields: dict[str, Any]) -> None:
        if not self._checked:  # logging is set up after the app is built
            self._checked, self._json = True, JsonLines.of(log.name)
        if self._json is not None:
            self._json.info("request", fields)
        else:
            log.info("request", extra={"fields": fields})

    def done(self, record: Record, now: float) -> None:
        request = record.request
        backend = record.served_by
        name, group = (backend.name, backend.spec.group) if backend else ("none", "none")
        status = record.status or 499  # nothing sent: the client went away first
        model = request.model if status != 404 else "unknown"  # no label per invented name
        m = self._m
        child = self._child
        child(m.requests, name, group, model, str(status)).inc()
        first, ttft = record.first_byte, None
        if first is not None:
            ttft = first - request.started
            child(m.ttft, name, group).observe(ttft)
            if record.chunks > 1 and record.last_byte is not None:
                child(m.inter_token, group).observe(
                    (record.last_byte - first) / (record.chunks - 1))
        duration = now - request.started
        child(m.duration, group).observe(duration)
        usage = record.usage
        if usage is not None:
            kind = "batch_" if record.priority == BATCH_BAND else ""
            child(m.tokens, record.tenant, model, kind + "prompt").inc(usage[0])
            child(m.tokens, record.tenant, model, kind + "completion").inc(usage[1])
        cached = request.cached
        predicted = cached.get(name, 0) if cached is not None else None
        if predicted is not None and record.cached is not None:
            self._predicted(name, predicted, record.cached)
        trace_id = None
        if self._tracing is not None:
            trace_id = self._tracing.done(record, status)
        if self._log and log.isEnabledFor(logging.INFO):
            self._line({
                "id": request.request_id, "trace_id": trace_id, "path": request.path,
                "model": request.model,
                "stream": request.stream, "client": request.client,
                "user_agent": user_agent(request.headers),
                "key": record.tenant, "backend": name, "group": group, "status": status,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
                "duration_ms": round(duration * 1000, 2),
                "chunks": record.chunks if request.stream else None,
                "tokens": list(usage) if usage is not None else None,
                "cached_predicted": predicted, "cached": record.cached,
                "kv_rule": cached.rule or None if cached is not None else None,
                "kv_standing": cached.standing.get(name) if cached is not None else None,
                "attempts": record.attempts, "note": record.note or None})

    def _predicted(self, backend: str, predicted: int, cached: int) -> None:
        """A prediction of the kv policy, against what vLLM said it found cached."""
        m = self._m
        m.kv_predicted.labels(backend).inc(predicted)
        m.kv_cached.labels(backend).inc(cached)
        result = "exact" if predicted == cached else "over" if predicted > cached else "under"
        m.kv_predictions.labels(backend, result).inc()

    def rejected(self, request_id: str, path: str, status: int, duration: float) -> None:
        """A request refused before its body could be read as one (413, 408, 400)."""
        self._m.requests.labels("none", "none", "unknown", str(status)).inc()
        if self._log and log.isEnabledFor(logging.INFO):
            self._line({
                "id": request_id, "path": path, "backend": "none", "group": "none",
                "status": status, "duration_ms": round(duration * 1000, 2)})
