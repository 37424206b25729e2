"""Where a request's attempts go, decided from what the gateway knows of its backends and
what the request's one Redis round trip said (``Facts``): its canary arm and mirror first,
then for each attempt the next backend (waiting in the queue while all are full), and after
each the verdict of the attempt table (``resilience.attempt.judge``): relay, retry
elsewhere, degrade or fail. No I/O but the queue's wait; the proxy runs what it decides."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from backends.backend import Backend
from gateway.canary.arms import Arms
from gateway.canary.rollout import Canary
from gateway.canary.shadow import Shadow
from gateway.config import UpstreamSection
from gateway.errors import GatewayError, ResponseUnavailable, UpstreamTimeout
from gateway.http.headers import header
from gateway.metrics import Metrics
from gateway.observability.tracing import Tracing
from gateway.request.cache import CacheLookup
from gateway.request.lookup import Lookup
from gateway.request.waking import Waking
from gateway.resilience.attempt import (
    Attempt,
    Failed,
    Next,
    judge,
    note_busy,
    retriable,
    settled,
)
from gateway.resilience.breaker import Outcome, Ticket
from gateway.resilience.retry import RetryBudget, backoff
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.routing.router import Router
from gateway.tenants.limits import Admission
from gateway.types import BATCH_BAND, Facts, Record
from gateway.upstream import UpstreamResponse

log = logging.getLogger("gateway.proxy")


Reply = UpstreamResponse | GatewayError | None  # what an attempt's request came back with


def result_of(reply: Reply) -> tuple[int | Failed, str]:
    """An attempt's result as ``judge`` reads it, and the cause the breaker is told."""
    if reply is None:
        return Failed.CONNECT, "connect"
    if isinstance(reply, GatewayError):
        failed = Failed.TIMEOUT if isinstance(reply, UpstreamTimeout) else Failed.BROKEN
        return failed, reply.message
    return reply.status, f"status {reply.status}"


def busy_reply(reply: Reply, backend: Backend) -> bool:
    """A 429/503 reply with Retry-After: its backend is skipped that long (``note_busy``)."""
    if reply is None or isinstance(reply, GatewayError):
        return False
    return note_busy(reply.status, header(reply.headers, b"retry-after"), backend)


@dataclass(slots=True)
class Plan:
    """One request's route as it goes: the backends tried (after those it must not try)."""

    record: Record
    facts: Facts | None
    tried: list[Backend] = field(default_factory=list)
    excluded: int = 0  # the first ``excluded`` of ``tried`` were never to be tried

    @property
    def asked(self) -> list[Backend]:
        return self.tried[self.excluded:]


class Planner:
    def __init__(self, router: Router, queue: WaitQueue, arms: Arms, canary: Canary,
                 shadow: Shadow, lookup: Lookup, pool: BackendPool, timeouts: UpstreamSection,
                 metrics: Metrics, tracing: Tracing | None,
                 tally: Callable[[Ticket, float], None],
                 cache: CacheLookup | None = None) -> None:
        self._router = router
        self._cache = cache  # routing.policy = "kv": what each candidate holds of a prompt
        self._tally = tally  # each attempt's outcome, counted by backend and arm
        self._lookup = lookup
        self._pool = pool
        self._queue = queue
        self._arms = arms
        self._canary = canary
        self._shadow = shadow
        self._timeouts = timeouts
        self._metrics = metrics
        self._tracing = tracing
        self._budget = RetryBudget(timeouts.retry_budget_ratio, timeouts.retry_budget_floor)
        self.waking = Waking(pool)

    async def begin(self, record: Record, admission: Admission | None) -> Plan:
        """The request's plan. Its canary arm is drawn and the backend its session would be
        pinned to if new is proposed; the lookup (its one Redis round trip) says what the
        key's limits, the session and a stored response it names decide; then its arm is
        settled (and mirrored to the canary while shadowing is on), or, when a stored
        response lives on one backend, that backend alone is planned."""
        self._arms.draw(record)
        proposed, sole = self._router.propose(record.request, record.group)
        # Asked during the round trip; after it when the key has limits (a refused request
        # makes vLLM render nothing).
        ask = self._cache is not None and not sole
        asking = (asyncio.ensure_future(self._cache(record.request, record.group))
                  if self._cache is not None and ask and admission is None else None)
        try:
            facts, only = await self._lookup(record, admission, proposed, sole)
            if self._cache is not None and ask and asking is None:
                asking = asyncio.ensure_future(self._cache(record.request, record.group))
            predicted = await asking if asking is not None else None
            if predicted is not None:
                record.request = replace(record.request, cached=predicted.cached)
                record.prediction = predicted
        finally:
            if asking is not None and not asking.done():
                asking.cancel()
        if not record.request.model:
            self._retrieval(record, only)
        self._budget.deposit()
        record.session = facts
        if only is not None:  # no arm, no mirror, no retry elsewhere
            record.group = None
            tried = [b for b in self._pool.backends if b is not only]
            return Plan(record, facts, tried, len(tried))
        self._arms.settle(record, facts)
        self.mirror(record)
        return Plan(record, facts)

    def _retrieval(self, record: Record, backend: Backend | None) -> None:
        """A retrieval or cancel of a stored response takes its model from the backend that
        stored it (its route has none); any backend's when where it is can't be known."""
        names = self._pool.names
        models = ([names.client(backend.spec.group, m) for m in sorted(backend.models)]
                  if backend is not None else self._pool.models())
        if not models:
            raise ResponseUnavailable(f"no backend can look up response "
                                      f"'{(record.request.follows or '')[:256]}' now")
        record.request = replace(record.request, model=models[0])

    def again(self, plan: Plan) -> Plan:
        """The fallback model's attempts: a plan of their own, the session not followed
        (its pin is the model's it asked for)."""
        plan.record.session = None
        return Plan(plan.record, None)

    def mirror(self, record: Record) -> None:
        """Stable traffic is mirrored to the canary while shadowing is on."""
        if (self._canary.enabled and record.group == self._canary.stable
                and self._canary.shadow()):
            record.shadow = self._shadow.mirror(record.request)

    async def place(self, plan: Plan, attempt: int) -> Ticket | None:
        """Attempt ``attempt``'s backend (waiting while all are full); stable's when the
        canary arm has none left; None when none can take it. The request takes one place
        however many attempts it makes."""
        record = plan.record
        ticket = await self._router.place(record.request, record.group, plan.tried,
                                          self._queue, record.tenant, record.priority,
                                          plan.facts, not record.outside_arm)
        if ticket is None and self._to_stable(plan):
            ticket = self._router.choose(record.request, record.group, plan.tried,
                                         facts=plan.facts, sticky=False)
        if ticket is not None and not record.placed:
            record.placed = True
            self._queue.take(record.tenant)
        if ticket is not None and record.prediction is not None:
            record.prediction.sent(ticket.backend.name)
        return ticket

    def attempt(self, ticket: Ticket, record: Record) -> Attempt:
        """The bookkeeping around one attempt on ``ticket.backend``."""
        return Attempt(ticket, record.request.started, self._tally)

    async def back_off(self, attempt: int, total: float) -> bool:
        """Wait before attempt ``attempt``; False when the pause would outlast the request
        (``total``, loop time). The next queued request is woken first: the place the last
        attempt held is free now, not when this request ends."""
        if not self._queue.idle:  # the last attempt's place is free now: the next one goes
            self._queue.freed()
        loop = asyncio.get_running_loop()
        pause = backoff(attempt - 1, self._timeouts.retry_backoff)
        if loop.time() + pause >= total:
            return False
        await asyncio.sleep(pause)
        return True

    def done(self, record: Record) -> None:
        """The request ended: the place it held goes to the next one waiting; what vLLM
        found cached corrects the prediction."""
        if record.prediction is not None:
            served = record.served_by
            record.prediction.ended(served.name if served is not None else None,
                                    record.cached)
        if record.placed:
            self._queue.give(record.tenant)
            if not self._queue.idle:
                self._queue.freed()
        if record.first_byte is not None and record.priority != BATCH_BAND:
            self._queue.pulse.note(record.first_byte - record.request.started)

    def judge(self, reply: UpstreamResponse | GatewayError | None, ticket: Ticket,
              plan: Plan, attempt: int) -> tuple[Outcome, Next]:
        """The attempt's verdict (``judge``): a busy backend is skipped for its Retry-After,
        a retry is paid for only when the result is retriable, and a settled outcome is told
        to the breaker at once (the others when the relay ends)."""
        result, cause = result_of(reply)
        if isinstance(result, int):
            ticket.status = result
        busy = busy_reply(reply, ticket.backend)
        retry = retriable(result) and self._may_retry(
            plan, attempt, "connect" if result is Failed.CONNECT else str(result))
        outcome, step = judge(result, busy, retry)
        if settled(result):
            ticket.done(outcome, cause)
        if self._tracing is not None:
            self._tracing.answered(plan.record, None if isinstance(result, Failed) else result,
                                   step in (Next.RETRY, Next.FAIL))
        return outcome, step

    def _may_retry(self, plan: Plan, attempt: int, reason: str) -> bool:
        """Commit to another attempt: one is left, another backend could take it, and the
        budget pays for it. Nothing reached the client yet, so a retry is invisible."""
        record = plan.record
        if attempt >= self._timeouts.max_attempts or not (self._router.can_retry(
                record.request, record.group, plan.tried) or self._to_stable(plan)):
            return False
        if not self._budget.withdraw():
            self._metrics.retry_budget_exhausted.inc()
            return False
        self._metrics.retries.labels(reason).inc()
        return True

    def _to_stable(self, plan: Plan) -> bool:
        record = plan.record
        return self._arms.to_stable(
            record, lambda group: self._router.can_retry(record.request, group, plan.tried))
