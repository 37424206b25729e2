"""OpenTelemetry spans, when ``[tracing] enabled`` (the optional extra ``vllm-gateway[otel]``).

One SERVER span per request, a child of the client's W3C ``traceparent`` when it sent one;
one CLIENT span per upstream attempt under it, whose context goes to vLLM as the attempt's
``traceparent`` (vLLM can trace too, ``--otlp-traces-endpoint``). The spans are made as the
attempts start and ended when the request is accounted for, with the backend, group, status,
retry and degraded flags; the request's trace id goes into its access-log line.

Off (the default), nothing here is imported and the request path holds ``None``: one
attribute test per request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gateway.config import TracingSection
from gateway.types import Record

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"


class _Spans:
    """A request's spans (``Record.trace``)."""

    __slots__ = ("attempts", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.attempts: list[Any] = []


class MissingExtra(RuntimeError):
    """``[tracing] enabled`` without the otel extra installed."""


class Tracing:
    def __init__(self, settings: TracingSection, processor: SpanProcessor | None = None) -> None:
        """``processor``: where finished spans go (tests give an in-memory exporter's);
        by default a batch processor exporting over OTLP/HTTP."""
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise MissingExtra("[tracing] enabled needs the otel extra: "
                               "pip install 'vllm-gateway[otel]'") from exc
        if processor is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint))
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("vllm-gateway")
        self._trace = trace
        self._kind = trace.SpanKind
        self._propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Export what is left (at the end of the process)."""
        self._provider.shutdown()

    def _wall_ns(self, loop_time: float) -> int:
        """A loop (monotonic) time as the wall-clock nanoseconds spans carry."""
        import asyncio
        return time.time_ns() - int((asyncio.get_running_loop().time() - loop_time) * 1e9)

    def _spans(self, record: Record) -> _Spans:
        """The request's spans, begun at its first attempt (dated from its arrival)."""
        spans = record.trace
        if not isinstance(spans, _Spans):
            request = record.request
            carrier = {name.decode("latin-1"): value.decode("latin-1")
                       for name, value in request.headers
                       if name in (_TRACEPARENT, _TRACESTATE)}
            parent = self._propagator.extract(carrier) if carrier else None
            spans = record.trace = _Spans(self._tracer.start_span(
                f"{request.method} {request.path}", context=parent, kind=self._kind.SERVER,
                start_time=self._wall_ns(request.started),
                attributes={"gen_ai.request.model": request.model,
                            "http.request.method": request.method, "url.path": request.path,
                            "gateway.request_id": request.request_id,
                            "gateway.stream": request.stream}))
        return spans

    def attempt(self, record: Record, backend_name: str, group: str, n: int,
                headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Begin attempt ``n``'s span; the upstream headers with its ``traceparent`` in
        place of the client's (``tracestate`` passes on as the client sent it)."""
        spans = self._spans(record)
        parent = self._trace.set_span_in_context(spans.request)
        span = self._tracer.start_span(
            f"upstream {backend_name}", context=parent, kind=self._kind.CLIENT,
            attributes={"gateway.backend": backend_name, "gateway.group": group,
                        "gateway.attempt": n, "gateway.retry": n > 1})
        spans.attempts.append(span)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        kept = [(k, v) for k, v in headers if k != _TRACEPARENT]
        if "traceparent" in carrier:
            kept.append((_TRACEPARENT, carrier["traceparent"].encode("latin-1")))
        return kept

    def answered(self, record: Record, status: int | None, over: bool) -> None:
        """The latest attempt's result: its status, or None when no reply came; ``over``:
        nothing of it is relayed (another attempt follows, or none), so its span ends now.
        A relayed attempt's span ends with the request."""
        spans = record.trace
        if isinstance(spans, _Spans) and spans.attempts:
            span = spans.attempts[-1]
            if status is None:
                span.set_attribute("gateway.failed", True)
                span.set_status(self._trace.StatusCode.ERROR)
            else:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(self._trace.StatusCode.ERROR)
            if over:
                spans.attempts.pop().end()

    def done(self, record: Record, status: int) -> str | None:
        """End the request's spans; its trace id (hex) for the log line, None when it was
        not sampled."""
        spans = self._spans(record)
        span = spans.request
        for attempt in spans.attempts:
            attempt.end()
        backend, note = record.served_by, record.note
        degraded = note.removeprefix("degraded ") if note.startswith("degraded ") else ""
        span.set_attributes({"http.response.status_code": status,
                             "gateway.attempts": record.attempts,
                             "gateway.backend": backend.name if backend else "none",
                             "gateway.group": backend.spec.group if backend else "none",
                             "gateway.degraded": degraded,
                             "gateway.retried": record.attempts > 1})
        if note:
            span.set_attribute("gateway.note", note)
        if status >= 500:
            span.set_status(self._trace.StatusCode.ERROR)
        span.end()
        context = span.get_span_context()
        return format(context.trace_id, "032x") if context.trace_flags.sampled else None


def make(settings: TracingSection) -> Tracing | None:
    return Tracing(settings) if settings.enabled else None


__all__ = ["MissingExtra", "Tracing", "make"]
