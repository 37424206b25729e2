"""The request path: parse once, choose a backend, forward, relay bytes as they come.

Each attempt's result is judged by one table (``resilience.attempt.judge``) and ``_serve``
follows its verdict; the relay and its per-chunk loop are in ``relay.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from starlette.types import Receive, Scope, Send

from backends.asgi import BodyTooLarge, read_body
from gateway.canary.arms import Arms
from gateway.canary.rollout import Canary
from gateway.canary.shadow import Shadow
from gateway.canary.tally import Tally
from gateway.config import Config
from gateway.errors import (
    GatewayError,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
)
from gateway.http import media
from gateway.http.asgi import (
    CLOSE,
    BodyBudget,
    content_length,
    request_id,
    send_error,
)
from gateway.http.deadline import Deadline
from gateway.http.sink import Hangup, close_lingering
from gateway.metrics import Metrics
from gateway.observability.access_log import RequestLog
from gateway.observability.tracing import Tracing
from gateway.proxy.lookup import Lookup
from gateway.proxy.opener import Opener
from gateway.proxy.parse import RequestParser
from gateway.proxy.plan import Plan, Planner
from gateway.proxy.relay import Relay
from gateway.proxy.rescue import Rescue
from gateway.proxy.resume import Resume
from gateway.resilience.attempt import Attempt, Next
from gateway.resilience.degraded import Degraded
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.routing.responses import ResponsePins
from gateway.routing.router import Router
from gateway.state.link import RedisLink
from gateway.tenants.gate import TenantGate
from gateway.tenants.limits import Admission
from gateway.types import Record
from gateway.upstream import Upstream

log = logging.getLogger("gateway.proxy")


class Proxy:
    """The ASGI endpoint behind every OpenAI POST route."""

    def __init__(
        self, config: Config, pool: BackendPool, upstream: Upstream, router: Router,
        degraded: Degraded, metrics: Metrics, canary: Canary, arms: Arms,
        responses: ResponsePins, gate: TenantGate, queue: WaitQueue, link: RedisLink | None,
        inject_usage: bool = False, tracing: Tracing | None = None,
    ) -> None:
        self._pool = pool
        self._gate = gate
        self._tally = Tally(metrics, canary)
        self._log = RequestLog(metrics, config.gateway.access_log, tracing)
        self._open = Opener(pool, upstream, responses, tracing)
        shadow = Shadow(upstream, router, pool, canary, metrics, config.upstream.total_timeout)
        lookup = Lookup(link, router.store, arms.store, canary, responses, gate, router.made)
        self._plans = Planner(router, queue, arms, canary, shadow, lookup, pool,
                              config.upstream, metrics, tracing)
        self._rescue = Rescue(pool, degraded)
        self._relay = Relay(pool, degraded.cache, config.degraded.cache_max_bytes, metrics)
        if config.resilience.continue_streams != "off":
            self._relay.resume = Resume(config.resilience, config.upstream, router, self._open,
                                        self._relay, metrics, self._tally.attempt, tracing)
        self._max_body = config.gateway.max_body_bytes
        self._held = BodyBudget(config.gateway.max_buffered_bytes)
        self._body_timeout = config.gateway.body_timeout
        self._timeouts = config.upstream
        self._parse = RequestParser(config, responses, pool, inject_usage)
        self._media_check = config.gateway.media_urls == "deny_private"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = request_id(scope)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        deadline = Deadline(begun + self._body_timeout)
        body = await self._read(scope, receive, send, rid, deadline, begun)
        if body is None:
            deadline.cancel()
            return
        task = asyncio.current_task()
        assert task is not None
        watcher = Hangup(scope, receive)
        record = None
        try:
            record = Record(self._parse(scope, body, rid, begun))
            admission = self._gate.start(scope, record)
            if self._media_check:
                await media.check(record.request.payload)
            await self._serve(record, send, deadline, admission)
        except GatewayError as exc:
            await send_error(send, exc, rid, exc.headers)
            if record is None:
                self._log.rejected(rid, scope["path"], exc.status, loop.time() - begun)
            else:
                record.status = exc.status
        except asyncio.CancelledError:
            if watcher.done() and task.uncancel() == 0:
                log.info("request %s: client disconnected, upstream cancelled", rid)
                if record is not None:
                    record.note = "client gone"
                    if record.shadow is not None:
                        record.shadow.cancel()  # the mirror goes with the client
                return
            raise
        finally:
            watcher.cancel()
            deadline.cancel()
            self._held.give(len(body))
            if record is not None:
                self._plans.done(record)
                self._gate.done(record)
                self._log.done(record, loop.time())

    async def _read(self, scope: Scope, receive: Receive, send: Send, rid: str,
                    deadline: Deadline, begun: float) -> bytes | None:
        """The request body, its bytes taken from the process's budget (the caller gives
        them back); None when the client left or was answered 413, 408 or 503. A declared
        length is judged before a byte is read; 408 and 413 close the connection."""
        declared = content_length(scope["headers"]) or 0
        held = 0
        try:
            if declared > self._max_body:
                raise BodyTooLarge(declared)
            if declared and not self._held.take(declared):
                raise Overloaded("too many request bytes held at once; retry shortly")
            held = declared
            body = await read_body(receive, self._max_body)
            if body is None:
                self._held.give(held)
                return None
            # From what was declared (0 when chunked) to what came: take more, or give back.
            if not self._held.take(len(body) - held):
                raise Overloaded("too many request bytes held at once; retry shortly")
            return body
        except BodyTooLarge:
            self._held.give(held)
            deadline.cancel()
            error: GatewayError = PayloadTooLarge(f"request body exceeds {self._max_body} bytes")
            extra = [CLOSE]
            close_lingering(scope)
        except Overloaded as exc:
            self._held.give(held)
            deadline.cancel()
            error, extra = exc, [(b"retry-after", b"1")]
        except asyncio.CancelledError:
            self._held.give(held)
            if not deadline.absorb():
                raise
            error = RequestTimeout(f"request body not received within {self._body_timeout:g} s")
            extra = [CLOSE]
            close_lingering(scope)
        await send_error(send, error, rid, extra)
        self._log.rejected(rid, scope["path"], error.status,
                           asyncio.get_running_loop().time() - begun)
        return None

    async def _serve(self, record: Record, send: Send, deadline: Deadline,
                     admission: Admission | None) -> None:
        total = asyncio.get_running_loop().time() + self._timeouts.total_timeout
        plan = await self._plans.begin(record, admission)  # its one Redis round trip
        await self._attempts(plan, send, deadline, total)

    async def _attempts(self, plan: Plan, send: Send, deadline: Deadline, total: float) -> None:
        """Attempt after attempt until one is relayed, or none can be, all before ``total``
        (loop time). The fallback model's attempts come here again."""
        loop = asyncio.get_running_loop()
        record = plan.record

        def again() -> Awaitable[None]:  # the fallback model's attempts, by the same deadline
            return self._attempts(self._plans.again(plan), send, deadline, total)
        failure: GatewayError | None = None
        for n in range(1, self._timeouts.max_attempts + 1):
            if n > 1 and not await self._plans.back_off(n, total):
                break
            ticket = await self._plans.place(plan, n)
            if ticket is None:
                break
            plan.tried.append(ticket.backend)
            record.attempts += 1  # a fallback model's attempts count on
            with Attempt(ticket, record.request.started, self._tally.attempt):
                deadline.until(min(total, loop.time() + self._timeouts.first_byte_timeout))
                reply = await self._open(ticket.backend, record, deadline)
                outcome, step = self._plans.judge(reply, ticket, plan, n)
                match step:
                    case Next.RETRY:
                        if reply is not None and not isinstance(reply, GatewayError):
                            log.info("request %s: backend %s answered %d, retrying elsewhere",
                                     record.request.request_id, ticket.backend.name,
                                     reply.status)
                            await reply.aclose(reuse=False)
                        continue
                    case Next.FAIL:
                        failure = reply if isinstance(reply, GatewayError) else None
                        break
                assert reply is not None and not isinstance(reply, GatewayError)
                if step is Next.DEGRADE and await self._rescue(
                        record, send, f"backend {ticket.backend.name} answered {reply.status}",
                        again, reply, ticket.backend):
                    return
                deadline.stream(self._timeouts.idle_timeout, total)
                await self._relay(reply, ticket, outcome, record, send, deadline)
                return
        await self._rescue.exhausted(record, plan.asked, failure, send, again)
