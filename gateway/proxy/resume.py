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
from gateway.proxy.opener import Opener
from gateway.proxy.relay import Relay
from gateway.resilience.attempt import Attempt
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.resume import Partial, Seam, continuation, eligible, fold
from gateway.resilience.sse import DONE
from gateway.routing.queue import NoRoom
from gateway.routing.router import Router
from gateway.types import Record, Request

log = logging.getLogger("gateway.proxy")


class Resume:
    def __init__(self, settings: ResilienceSection, timeouts: UpstreamSection, router: Router,
                 opener: Opener, relay: Relay, metrics: Metrics,
                 tally: Callable[[Ticket, float], None]) -> None:
        self._mode = settings.continue_streams
        self._max = settings.max_continuations
        self.room = settings.continue_max_bytes
        self._timeouts = timeouts
        self._router = router
        self._open = opener
        self._relay = relay
        self._counter = metrics.stream_continuations
        self._tally = tally

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
        ends it with an error event, as without continuation)."""
        original, tried = record.request, [failed.backend]
        total = original.started + self._timeouts.total_timeout
        for _ in range(self._max):
            partial = fold(original.path, parts)
            if isinstance(partial, str):
                return self._declined(record, partial)
            if partial.finished:  # only the end was missing
                await send({"type": "http.response.body", "body": DONE, "more_body": False})
                self._counter.labels("completed").inc()
                return True
            try:
                ticket = await self._router.choose(original, record.group, tried)
            except NoRoom:
                ticket = None
            if ticket is None:
                break
            tried.append(ticket.backend)
            done, kept = await self._attempt(record, original, partial, ticket, send, deadline,
                                             total, parts)
            self._note(record, tried, partial)
            if done:
                self._counter.labels("completed").inc()
                return True
            if kept is None:
                return self._declined(record, "over continue_max_bytes")
        self._counter.labels("failed").inc()
        record.note = (f"{record.note}, not finished" if record.note.startswith("stream cont")
                       else "stream dropped, no backend to continue it")
        return False

    async def _attempt(self, record: Record, original: Request, partial: Partial,
                       ticket: Ticket, send: Send, deadline: Deadline, total: float,
                       parts: list[bytes]) -> tuple[bool, list[bytes] | None]:
        """One continuation on ``ticket.backend``: whether it finished the stream, and the
        parts kept (None once over the cap)."""
        loop = asyncio.get_running_loop()
        record.request = continuation(original, partial)
        record.attempts += 1
        try:
            with Attempt(ticket, original.started, self._tally):
                deadline.until(min(total, loop.time() + self._timeouts.first_byte_timeout))
                reply = await self._open(ticket.backend, record, deadline)
                if reply is None or isinstance(reply, GatewayError) or reply.status != 200:
                    ticket.done(Outcome.FAILURE, "continuation refused")
                    if reply is not None and not isinstance(reply, GatewayError):
                        await reply.aclose(reuse=False)
                    return False, parts
                deadline.stream(self._timeouts.idle_timeout, total)
                room = self.room - sum(len(p) for p in parts)
                return await self._relay.resumed(reply, ticket, record, send, deadline,
                                                 Seam(original, partial), parts, room)
        finally:
            record.request = original

    @staticmethod
    def _note(record: Record, tried: list[Backend], partial: Partial) -> None:
        names = " -> ".join(b.name for b in tried)
        record.note = (f"stream continued {names} at char {len(partial.text)} "
                       f"(token {partial.tokens})")
