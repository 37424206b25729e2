"""The request path: parse once, choose a backend, forward, relay bytes as they come.

Each attempt's result is judged by one table (``resilience.attempt.judge``) and ``_serve``
follows its verdict; the relay and its per-chunk loop are in ``relay.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import replace

from starlette.types import Receive, Scope, Send

from backends.asgi import BodyTooLarge, read_body
from backends.backend import Backend
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
    ResponseUnavailable,
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
from gateway.proxy.opener import Opener, busy_reply, result_of
from gateway.proxy.parse import RequestParser
from gateway.proxy.relay import Relay
from gateway.proxy.rescue import Rescue
from gateway.proxy.resume import Resume
from gateway.resilience.attempt import Attempt, Failed, Next, judge, retriable, settled
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.degraded import Degraded
from gateway.resilience.retry import RetryBudget, backoff
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.routing.responses import ResponsePins
from gateway.routing.router import Router
from gateway.tenants.gate import TenantGate
from gateway.types import Record
from gateway.upstream import Upstream, UpstreamResponse

log = logging.getLogger("gateway.proxy")


class Proxy:
    """The ASGI endpoint behind every OpenAI POST route."""

    def __init__(
        self, config: Config, pool: BackendPool, upstream: Upstream, router: Router,
        degraded: Degraded, metrics: Metrics, canary: Canary, arms: Arms,
        responses: ResponsePins, gate: TenantGate, queue: WaitQueue,
        inject_usage: bool = False, tracing: Tracing | None = None,
    ) -> None:
        self._pool = pool
        self._gate = gate
        self._queue = queue
        self._responses = responses
        self._canary = canary
        self._arms = arms
        self._tally = Tally(metrics, canary)
        self._log = RequestLog(metrics, config.gateway.access_log, tracing)
        self._tracing = tracing
        self._open = Opener(pool, upstream, responses, tracing)
        self._shadow = Shadow(upstream, router, pool, canary, metrics,
                              config.upstream.total_timeout)
        self._rescue = Rescue(pool, degraded)
        self._relay = Relay(pool, degraded.cache, config.degraded.cache_max_bytes, metrics)
        if config.resilience.continue_streams != "off":
            self._relay.resume = Resume(config.resilience, config.upstream, router, self._open,
                                        self._relay, metrics, self._tally.attempt, tracing)
        self._metrics = metrics
        self._router = router
        self._budget = RetryBudget(config.upstream.retry_budget_ratio,
                                   config.upstream.retry_budget_floor)
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
        record = admitting = None
        try:
            record = Record(self._parse(scope, body, rid, begun))
            admitting = self._gate.start(scope, record)
            if self._media_check:
                await media.check(record.request.payload)
            await self._serve(record, send, deadline, admitting)
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
                if record.placed:
                    self._queue.give(record.tenant)  # the place it held: the next one goes
                    if not self._queue.idle:
                        self._queue.freed()
                self._gate.done(record, admitting)
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
                     admitting: asyncio.Task[None] | None) -> None:
        self._budget.deposit()
        total = asyncio.get_running_loop().time() + self._timeouts.total_timeout
        only = await self._stored(record) if record.request.follows else None
        if only is None:
            arm = self._arms.assign(record)  # the session's stored arm: with its pin, one trip
            drawn = record.group  # the task may change it as soon as the pin lookup yields
            if arm is None:
                self._mirror(record)
            await self._attempts(record, send, deadline, total, arm, drawn, [], admitting)
        else:  # a stored response's backend, or none: no arm, no mirror, no retry elsewhere
            await self._attempts(record, send, deadline, total, None, None,
                                 [b for b in self._pool.backends if b is not only], admitting)

    async def _attempts(self, record: Record, send: Send, deadline: Deadline, total: float,
                        arm: asyncio.Task[None] | None, drawn: str | None,
                        tried: list[Backend], admitting: asyncio.Task[None] | None) -> None:
        """Attempt after attempt until one is relayed, or none can be, all before ``total``
        (loop time); ``tried`` starts with the backends that must not be tried at all. The
        key's limits (``admitting``) are checked while the first backend is chosen, and
        awaited before it is asked. The fallback model's attempts come here again."""
        loop = asyncio.get_running_loop()
        request = record.request
        excluded = len(tried)

        def again() -> Awaitable[None]:  # the fallback model's attempts, by the same deadline
            return self._attempts(record, send, deadline, total, None, None, [], None)
        failure: GatewayError | None = None
        for n in range(1, self._timeouts.max_attempts + 1):
            ticket = await self._place(record, tried, arm, drawn, n > 1)
            arm = None
            if admitting is not None and ticket is not None:
                await _admitted(admitting, ticket)
                admitting = None
            if ticket is None or (n > 1 and not await self._back_off(n, total, loop)):
                break
            tried.append(ticket.backend)
            record.attempts += 1  # a fallback model's attempts count on
            self._hold(record)
            with Attempt(ticket, request.started, self._tally.attempt):
                deadline.until(min(total, loop.time() + self._timeouts.first_byte_timeout))
                reply = await self._open(ticket.backend, record, deadline)
                outcome, step = self._judge(reply, ticket, record, tried, n)
                match step:
                    case Next.RETRY:
                        if reply is not None and not isinstance(reply, GatewayError):
                            log.info("request %s: backend %s answered %d, retrying elsewhere",
                                     request.request_id, ticket.backend.name, reply.status)
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
        if admitting is not None:  # the key's limits decide before any other answer
            await admitting
        await self._rescue.exhausted(record, tried[excluded:], failure, send, again)

    async def _place(self, record: Record, tried: list[Backend], arm: asyncio.Task[None] | None,
                     drawn: str | None, retry: bool = False) -> Ticket | None:
        """The next attempt's backend (waiting while all are full); the session's stored arm
        settled on the first; stable's when the canary arm has none left. A ``retry`` first
        wakes the next queued request: the place the last attempt held is free now, not when
        this request ends."""
        if retry and not self._queue.idle:
            self._queue.freed()
        ticket = await self._router.place(record.request, record.group, tried, self._queue,
                                          record.tenant, record.priority, not record.outside_arm)
        if arm is not None:
            ticket = await self._settle_arm(record, arm, drawn, ticket)
        if ticket is None and self._to_stable(record, tried):
            ticket = await self._router.choose(record.request, record.group, tried, sticky=False)
        return ticket

    def _hold(self, record: Record) -> None:
        """One place per request (given back when it ends), however many attempts."""
        if not record.placed:
            record.placed = True
            self._queue.take(record.tenant)

    async def _stored(self, record: Record) -> Backend | None:
        """The backend holding the stored response a request names (None: any may take it).
        A retrieval or cancel takes its model from that backend (its route has none)."""
        request = record.request
        assert request.follows is not None
        retrieval = not request.model
        backend = (await self._responses.where(request.follows, retrieval)
                   if self._responses.enabled else None)
        if retrieval:
            names = self._pool.names
            models = ([names.client(backend.spec.group, m) for m in sorted(backend.models)]
                      if backend is not None else self._pool.models())
            if not models:
                raise ResponseUnavailable(f"no backend can look up response "
                                          f"'{request.follows[:256]}' now")
            record.request = replace(request, model=models[0])
        return backend

    async def _settle_arm(self, record: Record, arm: asyncio.Task[None],
                          drawn: str | None, ticket: Ticket | None) -> Ticket | None:
        """Wait for the session's stored arm; choose again in the rare case it is another
        group than the one drawn (a weight changed since the session began). Then mirror a
        stable request to the canary when shadowing is on."""
        await arm
        if record.group != drawn:
            if ticket is not None:
                ticket.done(Outcome.NEUTRAL)
            ticket = await self._router.choose(record.request, record.group)
        self._mirror(record)
        return ticket

    def _to_stable(self, record: Record, tried: list[Backend]) -> bool:
        return self._arms.to_stable(
            record, lambda group: self._router.can_retry(record.request, group, tried))

    def _mirror(self, record: Record) -> None:
        """Stable traffic is mirrored to the canary while shadowing is on."""
        if (self._canary.enabled and record.group == self._canary.stable
                and self._canary.shadow()):
            record.shadow = self._shadow.mirror(record.request)

    async def _back_off(self, n: int, total: float, loop: asyncio.AbstractEventLoop) -> bool:
        """Wait before attempt ``n``; False when the pause would outlast the request."""
        pause = backoff(n - 1, self._timeouts.retry_backoff)
        if loop.time() + pause >= total:
            return False
        await asyncio.sleep(pause)
        return True

    def _judge(self, reply: UpstreamResponse | GatewayError | None, ticket: Ticket,
               record: Record, tried: list[Backend], n: int) -> tuple[Outcome, Next]:
        """The attempt's verdict (``judge``): a busy backend is skipped for its Retry-After,
        a retry is paid for only when the result is retriable, and a settled outcome is told
        to the breaker at once (the others when the relay ends)."""
        result, cause = result_of(reply)
        if isinstance(result, int):
            ticket.status = result
        busy = busy_reply(reply, ticket.backend)
        retry = retriable(result) and self._may_retry(
            record, tried, n, "connect" if result is Failed.CONNECT else str(result))
        outcome, step = judge(result, busy, retry)
        if settled(result):
            ticket.done(outcome, cause)
        if self._tracing is not None:
            self._tracing.answered(record, None if isinstance(result, Failed) else result,
                                   step in (Next.RETRY, Next.FAIL))
        return outcome, step

    def _may_retry(self, record: Record, tried: list[Backend], attempt: int,
                   reason: str) -> bool:
        """Commit to another attempt: one is left, another backend could take it, and the
        budget pays for it. Nothing reached the client yet, so a retry is invisible."""
        if attempt >= self._timeouts.max_attempts or not (self._router.can_retry(
                record.request, record.group, tried) or self._to_stable(record, tried)):
            return False
        if not self._budget.withdraw():
            self._metrics.retry_budget_exhausted.inc()
            return False
        self._metrics.retries.labels(reason).inc()
        return True


async def _admitted(admitting: asyncio.Task[None], ticket: Ticket) -> None:
    """The key's limits let it through, or their refusal is raised (the ticket unused)."""
    try:
        await admitting
    except GatewayError:
        ticket.done(Outcome.NEUTRAL)
        raise
