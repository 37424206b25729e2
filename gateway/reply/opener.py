"""One attempt's request sent upstream: the backend's reply, or why there is none."""

from __future__ import annotations

import asyncio
import logging

from backends.backend import Backend
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.http.deadline import Deadline
from gateway.http.headers import upstream_request_headers
from gateway.observability.tracing import Tracing
from gateway.request.plan import Reply
from gateway.routing.pool import BackendPool
from gateway.routing.responses import ResponsePins
from gateway.types import Record
from gateway.upstream import ConnectFailed, Upstream, UpstreamBroken

log = logging.getLogger("gateway.proxy")


class Opener:
    def __init__(self, pool: BackendPool, upstream: Upstream, responses: ResponsePins,
                 tracing: Tracing | None) -> None:
        self._pool = pool  # asked for the model map each time: a reload replaces it
        self._upstream = upstream
        self._responses = responses
        self._tracing = tracing

    async def __call__(self, backend: Backend, record: Record, deadline: Deadline) -> Reply:
        """Send the request: the reply; None when no connection could be made (another
        backend may be tried); the error when it broke or no headers came in time."""
        request = record.request
        headers = upstream_request_headers(request.headers, backend, request.request_id,
                                           request.forwarded_for)
        if self._tracing is not None:
            headers = self._tracing.attempt(record, backend.name, backend.spec.group,
                                            record.attempts, headers)
        body = self._pool.names.body_for(request, backend.spec.group)
        adapters = self._pool.adapters.specs
        try:
            # A LoRA adapter is loaded there first (AdapterRefused, raised, counts against
            # no breaker; an instance that did not answer is another attempt's to try).
            adapter = self._pool.served(backend, request.model) if adapters else None
            if adapter in adapters and not await self._pool.adapters.ensure(
                    backend, adapter, self._upstream):
                return None
            reply = await self._upstream.request(request.method, backend.url + request.path,
                                                 headers, body)
            if request.creates is not None and reply.status == 200:
                await self._responses.record(request.creates, backend)
            return reply
        except ConnectFailed as exc:
            log.warning("request %s: backend %s unreachable: %s", request.request_id,
                        backend.name, exc)
            return None
        except UpstreamBroken as exc:
            # The detail (the library's words, maybe the backend's bytes) is for the log only.
            log.warning("request %s: backend %s failed before its response headers: %s",
                        request.request_id, backend.name, exc)
            return UpstreamUnavailable(f"backend {backend.name} failed before its response "
                                       "headers")
        except asyncio.CancelledError:
            if not deadline.absorb():
                raise
            return UpstreamTimeout(f"backend {backend.name} sent no response headers in time")
