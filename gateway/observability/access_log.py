"""Accounting of client requests: one record per request (metrics and one structured
access-log line), written when it ends."""

from __future__ import annotations

import logging

from gateway.metrics import Metrics
from gateway.types import RequestContext

log = logging.getLogger("gateway.access")


class RequestLog:
    def __init__(self, metrics: Metrics, access_log: bool) -> None:
        self._m = metrics
        self._log = access_log

    def done(self, ctx: RequestContext, now: float) -> None:
        backend = ctx.served_by
        name, group = (backend.name, backend.spec.group) if backend else ("none", "none")
        status = ctx.status or 499  # nothing sent: the client went away first
        model = ctx.model if status != 404 else "unknown"  # no label per invented name
        m = self._m
        m.requests.labels(name, group, model, str(status)).inc()
        ttft = None if ctx.first_byte is None else ctx.first_byte - ctx.started
        if ttft is not None:
            m.ttft.labels(group).observe(ttft)
            if ctx.chunks > 1 and ctx.last_byte is not None:
                m.inter_token.labels(group).observe(
                    (ctx.last_byte - ctx.first_byte) / (ctx.chunks - 1))  # type: ignore[operator]
        duration = now - ctx.started
        m.duration.labels(group).observe(duration)
        if self._log and log.isEnabledFor(logging.INFO):
            log.info("request", extra={"fields": {
                "id": ctx.request_id, "path": ctx.path, "model": ctx.model, "stream": ctx.stream,
                "backend": name, "group": group, "status": status,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
                "duration_ms": round(duration * 1000, 2),
                "chunks": ctx.chunks if ctx.stream else None, "note": ctx.note or None}})

    def rejected(self, request_id: str, path: str, status: int, duration: float) -> None:
        """A request refused before its body could be read as one (413, 408, 400)."""
        self._m.requests.labels("none", "none", "unknown", str(status)).inc()
        if self._log and log.isEnabledFor(logging.INFO):
            log.info("request", extra={"fields": {
                "id": request_id, "path": path, "backend": "none", "group": "none",
                "status": status, "duration_ms": round(duration * 1000, 2)}})
