"""The request path: read the body, parse once, plan, then run the plan's attempts.

The plan (``gateway.request``: the parsed request, its one Redis round trip, the ordered
candidates and the verdict on each attempt) says where each attempt goes and what follows
it; the reply (``gateway.reply``) is opened, relayed, continued or rescued there. This
module only runs the attempt loop between them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from starlette.types import Receive, Scope, Send

from backends.asgi import BodyTooLarge, read_body
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
from gateway.observability.access_log import RequestLog
from gateway.reply.opener import Opener
from gateway.reply.relay import Relay
from gateway.reply.rescue import Rescue
from gateway.request.parse import RequestParser
from gateway.request.plan import Plan, Planner
from gateway.resilience.attempt import Next
from gateway.tenants.gate import TenantGate
from gateway.tenants.limits import Admission
from gateway.types import Record

log = logging.getLogger("gateway.proxy")


class Proxy:
    """The ASGI endpoint behind every OpenAI POST route."""

    def __init__(self, config: Config, parse: RequestParser, gate: TenantGate,
                 plans: Planner, opener: Opener, relay: Relay, rescue: Rescue,
                 access: RequestLog) -> None:
        """The parts are built by ``gateway.build``: the request is read here, its plan made
        by ``gateway.request``, and each attempt's reply opened, relayed or rescued by
        ``gateway.reply``."""
        self._parse = parse
        self._gate = gate
        self._plans = plans
        self._open = opener
        self._relay = relay
        self._rescue = rescue
        self._log = access
        self._max_body = config.gateway.max_body_bytes
        self._held = BodyBudget(config.gateway.max_buffered_bytes)
        self._body_timeout = config.gateway.body_timeout
        self._timeouts = config.upstream
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
        loop, waking = asyncio.get_running_loop(), self._plans.waking
        wait = waking.within(record.request.model)
        if wait is not None:  # its model's instances are stopped: one is being started
            deadline.until(loop.time() + wait + 1.0)
            await waking(record.request.model, wait)
        total = loop.time() + self._timeouts.total_timeout
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
            with self._plans.attempt(ticket, record):
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
