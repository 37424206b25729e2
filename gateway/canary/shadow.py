"""Shadow requests: stable traffic mirrored to the canary group, answers thrown away."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from gateway.canary.rollout import Canary
from gateway.canary.tally import Tally
from gateway.http.headers import upstream_request_headers
from gateway.metrics import Metrics
from gateway.resilience.attempt import Attempt, judge
from gateway.resilience.breaker import Outcome
from gateway.routing.pool import BackendPool
from gateway.routing.router import Router
from gateway.types import Request
from gateway.upstream import Upstream, UpstreamError

log = logging.getLogger("gateway.shadow")


class Shadow:
    """Mirrors a request to the canary group; the answer is read and thrown away."""

    def __init__(self, upstream: Upstream, router: Router, pool: BackendPool, canary: Canary,
                 metrics: Metrics, timeout: float) -> None:
        self._upstream = upstream
        self._router = router
        self._pool = pool  # asked for the model map each time: a reload replaces it
        self._canary = canary
        self._counter = metrics.shadow_requests
        self._tally = Tally(metrics, canary)
        self._timeout = timeout
        self._tasks: set[asyncio.Task[None]] = set()

    def mirror(self, request: Request) -> asyncio.Task[None]:
        copy = dataclasses.replace(request, session_key=None,
                                   request_id=request.request_id + "-shadow")
        task = asyncio.create_task(self._run(copy, self._canary.group), name="shadow")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(self, request: Request, group: str) -> None:
        ticket = self._router.choose(request, group)
        if ticket is None:
            self._counter.labels("no_backend").inc()
            return
        backend = ticket.backend
        loop = asyncio.get_running_loop()
        with Attempt(ticket, loop.time(), self._tally.attempt):
            try:
                async with asyncio.timeout(self._timeout):
                    resp = await self._upstream.request(
                        "POST", backend.url + request.path,
                        upstream_request_headers(request.headers, backend, request.request_id,
                                                 request.forwarded_for),
                        self._pool.names.body_for(request, backend.spec.group))
                    ticket.status = resp.status
                    try:
                        chunk = await resp.read()
                        ticket.first_byte = loop.time()
                        while chunk:
                            chunk = await resp.read()
                    finally:
                        await resp.aclose(reuse=False)
                outcome, _ = judge(resp.status)  # not busy, never retried: the status alone
                ticket.done(outcome)
                self._counter.labels("error" if outcome is Outcome.FAILURE else "ok").inc()
            except (UpstreamError, TimeoutError) as exc:
                ticket.done(Outcome.FAILURE, type(exc).__name__)
                self._counter.labels("error").inc()
            except asyncio.CancelledError:
                self._counter.labels("cancelled").inc()
                raise

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
