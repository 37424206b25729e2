"""A stream whose backend failed after it began, finished on another backend from exactly
where the client is (``[resilience] continue_streams``; the pieces are in
``gateway.resilience.resume``).

The relay keeps an eligible stream's chunks by reference, as the reply cache does; only when
the stream breaks are they folded into the partial answer. The continuation goes to another
candidate of the same group (breakers, health and the session's pin as for any request: the
pin moves to the backend that finishes), and its chunks reach the client through ``Seam``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import Send

from backends.backend import Backend
from gateway.config import ResilienceSection, UpstreamSection
from gateway.errors import GatewayError
from gateway.http.deadline import Deadline
from gateway.metrics import Metrics
from gateway.observability.tracing import Tracing
from gateway.reply.opener import Opener
from gateway.reply.relay import Relay
from gateway.request.plan import Reply, busy_reply, result_of
from gateway.resilience.attempt import Attempt, Failed, judge, stepped_out
from gateway.resilience.breaker import Ticket
from gateway.resilience.resume import Partial, Seam, continuation, eligible, fold
from gateway.resilience.sse import DONE
from gateway.routing.queue import NoRoom
from gateway.routing.router import Router
from gateway.types import Record, Request

log = logging.getLogger("gateway.proxy")


class Resume:
    def __init__(self, settings: ResilienceSection, timeouts: UpstreamSection, router: Router,
                 opener: Opener, relay: Relay, metrics: Metrics,
                 tally: Callable[[Ticket, float], None], tracing: Tracing | None) -> None:
        self._mode = settings.continue_streams
        self._max = settings.max_continuations
        self.room = settings.continue_max_bytes
        self._timeouts = timeouts
        self._router = router
        self._open = opener
        self._relay = relay
        self._counter = metrics.stream_continuations
        self._tally = tally
        self._tracing = tracing

    def wants(self, request: Request) -> bool:
        """May this stream be continued if it breaks (its chunks are then kept)?"""
        return eligible(request, self._mode)

    def _declined(self, record: Record, why: str) -> bool:
        self._counter.labels("declined").inc()
        log.info("request %s: stream not continued: %s", record.request.request_id, why)
        return False

    async def __call__(self, record: Record, parts: list[bytes], failed: Ticket, send: Send,
                       deadline: Deadline) -> bool:
        """Finish the broken stream elsewhere; False when it could not be (the caller then
        ends it with an error event, as without continuation). The failed backend does not
        count the request in flight meanwhile."""
        original = record.request
        try:
            with stepped_out(failed.backend):
                return await self._continue(record, parts, [failed.backend], send, deadline)
        except asyncio.CancelledError:  # the deadline fired between attempts
            if not deadline.absorb():
                raise
            return self._declined(record, "the request's deadline passed")
        finally:
            record.request = original

    async def _continue(self, record: Record, parts: list[bytes], tried: list[Backend],
                        send: Send, deadline: Deadline) -> bool:
        loop = asyncio.get_running_loop()
        original = record.request
        total = original.started + self._timeouts.total_timeout
        for _ in range(self._max):
            partial = fold(original.path, parts)
            if isinstance(partial, str):
                return self._declined(record, partial)
            if partial.done:  # the client has its [DONE]: the stream is whole
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return True
            if partial.finished:  # only the end was missing
                self._lost_usage(record, partial)
                await send({"type": "http.response.body", "body": DONE, "more_body": False})
                self._counter.labels("completed").inc()
                return True
            if loop.time() >= total:
                return self._declined(record, "the request's total_timeout is spent")
            try:
                ticket = self._router.choose(original, record.group, tried,
                                             facts=record.session)
            except NoRoom:
                ticket = None
            if ticket is None:
                break
            tried.append(ticket.backend)
            why = await self._attempt(record, partial, ticket, send, deadline, total, parts)
            self._note(record, tried, partial)
            if why is None:
                self._counter.labels("completed").inc()
                return True
            if why:
                return self._declined(record, why)
        self._counter.labels("failed").inc()
        record.note = (f"{record.note}, not finished" if record.note.startswith("stream cont")
                       else "stream dropped, no backend to continue it")
        return False

    async def _attempt(self, record: Record, partial: Partial, ticket: Ticket, send: Send,
                       deadline: Deadline, total: float, parts: list[bytes]) -> str | None:
        """One continuation on ``ticket.backend``: None when it finished the stream, "" when
        another backend may try, else why none should."""
        original = record.request
        record.request = continuation(original, partial)
        record.attempts += 1
        try:
            return await self._relayed(record, original, partial, ticket, send, deadline,
                                       total, parts)
        finally:
            record.request = original

    async def _relayed(self, record: Record, original: Request, partial: Partial,
                       ticket: Ticket, send: Send, deadline: Deadline, total: float,
                       parts: list[bytes]) -> str | None:
        loop = asyncio.get_running_loop()
        with Attempt(ticket, loop.time(), self._tally):  # its own TTFT, not the request's
            deadline.until(min(total, loop.time() + self._timeouts.first_byte_timeout))
            reply = await self._open(ticket.backend, record, deadline)
            result, cause = result_of(reply)
            if self._tracing is not None:
                self._tracing.answered(record, result if isinstance(result, int) else None,
                                       result != 200)
            if reply is None or isinstance(reply, GatewayError) or reply.status != 200:
                return await self._refused(ticket, reply, result, cause)
            deadline.stream(self._timeouts.idle_timeout, total)
            room = self.room - sum(len(p) for p in parts)
            done, kept = await self._relay.resumed(reply, ticket, record, send, deadline,
                                                   Seam(original, partial), parts, room)
        return None if done else "" if kept is not None else "over continue_max_bytes"

    @staticmethod
    async def _refused(ticket: Ticket, reply: Reply, result: int | Failed, cause: str) -> str:
        """A continuation that got no stream, judged as any attempt (a 4xx or a 429 does not
        count against the backend); "" when another backend may try (no reply, a 5xx, a
        429), else why not (the request itself was refused: another would refuse it too)."""
        busy = busy_reply(reply, ticket.backend)
        if reply is not None and not isinstance(reply, GatewayError):
            await reply.aclose(reuse=False)
        outcome, _ = judge(result, busy)
        ticket.done(outcome, f"continuation: {cause}")
        if isinstance(result, int) and result < 500 and result != 429:
            return f"the continuation was refused ({cause})"
        return ""

    @staticmethod
    def _lost_usage(record: Record, partial: Partial) -> None:
        """The stream broke between its last text and its usage chunk: the completion
        tokens the client got are counted (the prompt's are not known)."""
        if not partial.usage and record.usage is None:
            record.usage = (0, partial.tokens)

    @staticmethod
    def _note(record: Record, tried: list[Backend], partial: Partial) -> None:
        names = " -> ".join(b.name for b in tried)
        record.note = (f"stream continued {names} at char {len(partial.text)} "
                       f"(token {partial.tokens})")
