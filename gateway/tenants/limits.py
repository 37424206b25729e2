"""Each key's limits (requests and tokens per minute, requests at once), exact across every
worker and replica: one Lua script in Redis checks and takes all three atomically, in the
one round trip the request makes before it is forwarded.

Minutes are fixed windows (``lim:NAME:r:MINUTE``, ``lim:NAME:t:MINUTE``); a request's tokens
are charged by an estimate on the way in (prompt bytes / 4 + the tokens it may generate)
and corrected with vLLM's ``usage`` on the way out. Requests at once are a sorted set of
request ids (``lim:NAME:c``) whose members older than the longest a request may take are
dropped, so a replica that died holding some does not hold them forever.

Redis down: ``fail_open`` applies each process's share of every limit locally (the limit /
(replicas x workers)); ``fail_closed`` answers 503 to keys that have limits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config.tenancy import LimitsSection
from gateway.errors import Forbidden, NoBackend, RateLimited
from gateway.metrics import Metrics
from gateway.state.link import Command, RedisLink
from gateway.tenants.keyring import Tenant
from gateway.types import Request

SCRIPT = """
local rpm, tpm, est, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
local now, stale, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if rpm > 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= rpm then return 'rpm' end
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
if tpm > 0 and used > 0 and used + est > tpm then return 'tpm' end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - stale)
  if redis.call('ZCARD', KEYS[3]) >= conc then return 'concurrency' end
  redis.call('ZADD', KEYS[3], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], stale)
end
if rpm > 0 then redis.call('INCR', KEYS[1]); redis.call('PEXPIRE', KEYS[1], ttl) end
if tpm > 0 then redis.call('INCRBY', KEYS[2], est); redis.call('PEXPIRE', KEYS[2], ttl) end
return 'ok'
"""
WINDOW = 60  # seconds in a rate window
KEEP_MS = 2 * WINDOW * 1000  # a window's counters outlive it, for the admin view


@dataclass(slots=True)
class Admission:
    """What a limited request holds until it ends."""

    tenant: Tenant
    member: str  # its id in the concurrency set
    minute: int  # the window its tokens were charged to
    estimate: int
    at: float  # when it was taken (the clock's time)
    local: bool = False  # taken from this process's share (Redis was down)


@dataclass(slots=True)
class _Share:
    """One process's share of a tenant's limits, while Redis is down."""

    minute: int = 0
    requests: int = 0
    tokens: int = 0
    running: set[str] = field(default_factory=set)


def estimate(request: Request, default_max_tokens: int) -> int:
    """Tokens a request may cost before vLLM says: prompt bytes / 4 and its token cap."""
    payload = request.payload
    cap = next((v for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                if isinstance(v := payload.get(k), int) and not isinstance(v, bool)),
               default_max_tokens)
    return len(request.body) // 4 + max(0, cap)


class Limits:
    def __init__(self, link: RedisLink | None, settings: LimitsSection, processes: int,
                 stale: float, metrics: Metrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._link = link
        self._settings = settings
        self._divisor = settings.replicas * processes
        self._stale_ms = int(stale * 1000)
        self._prefix = (link.prefix if link is not None else "") + "lim:"
        self._metrics = metrics
        self._clock = clock
        self._shares: dict[str, _Share] = {}

    def prepare(self, tenant: Tenant, request: Request) -> Admission | None:
        """What taking one request from ``tenant``'s limits needs (None: it has none), or
        403 when its key may not use the model. The check itself is ``command``, sent in
        the request's one round trip, and its answer is judged by ``settle``."""
        if not tenant.allows(request.model):
            self._reject(tenant, "model")
            raise Forbidden(f"key '{tenant.name}' may not use model '{request.model[:200]}'",
                            "model")
        if not tenant.limited:
            return None
        now = self._clock()
        cost = estimate(request, self._settings.default_max_tokens) if tenant.tpm else 0
        return Admission(tenant, request.request_id, int(now // WINDOW), cost, now)

    def command(self, a: Admission) -> Command:
        """The script that checks and takes all three limits at once."""
        t, key = a.tenant, self._prefix + a.tenant.name
        return ("EVAL", SCRIPT, 3, f"{key}:r:{a.minute}", f"{key}:t:{a.minute}", f"{key}:c",
                t.rpm, t.tpm, a.estimate, t.max_concurrent, a.member, int(a.at * 1000),
                self._stale_ms, KEEP_MS)

    def settle(self, a: Admission, answered: bool, result: object) -> None:
        """Judge the script's answer: through, or 429 (503 when it can't be checked and the
        policy is ``fail_closed``); unanswered, this process's share decides."""
        verdict = str(result) if answered and not isinstance(result, Exception) else None
        if verdict is None:
            verdict = self._locally(a)
        if verdict != "ok":
            self._refuse(a.tenant, verdict, a.at)

    async def admit(self, tenant: Tenant, request: Request) -> Admission | None:
        """``prepare``, ``command`` and ``settle`` in a round trip of their own."""
        admission = self.prepare(tenant, request)
        if admission is not None:
            answered, results = ((await self._link.execute(self.command(admission)))
                                 if self._link is not None else (False, []))
            self.settle(admission, answered, results[0] if answered else None)
        return admission

    def _locally(self, a: Admission) -> str:
        """Redis can't answer: this process's share, or 503 (``fail_closed``)."""
        t = a.tenant
        if self._settings.on_redis_down == "fail_closed":
            self._reject(t, "redis")
            raise NoBackend("limits can't be checked now; retry shortly")
        a.local = True
        share = self._shares.setdefault(t.name, _Share())
        if share.minute != a.minute:
            share.minute, share.requests, share.tokens = a.minute, 0, 0
        if t.rpm and share.requests >= self._part(t.rpm):
            return "rpm"
        if t.tpm and share.tokens and share.tokens + a.estimate > self._part(t.tpm):
            return "tpm"
        if t.max_concurrent and len(share.running) >= self._part(t.max_concurrent):
            return "concurrency"
        share.requests += 1
        share.tokens += a.estimate
        share.running.add(a.member)
        return "ok"

    def _part(self, limit: int) -> int:
        return max(1, limit // self._divisor)

    def _refuse(self, tenant: Tenant, limit: str, now: float) -> None:
        self._reject(tenant, limit)
        if limit == "concurrency":
            raise RateLimited(f"key '{tenant.name}' has {tenant.max_concurrent} requests in "
                              "flight, its limit", 1)
        wait = math.ceil(WINDOW - now % WINDOW)
        what, kind = (("requests", "requests") if limit == "rpm" else ("tokens", "tokens"))
        cap = tenant.rpm if limit == "rpm" else tenant.tpm
        raise RateLimited(f"Rate limit reached for key '{tenant.name}' on {what} per minute: "
                          f"limit {cap}. Retry after {wait} s.", wait, kind)

    def _reject(self, tenant: Tenant, limit: str) -> None:
        self._metrics.limit_rejections.labels(tenant.name, limit).inc()

    def release(self, a: Admission, used: int | None) -> None:
        """The request ended: its place back, its tokens corrected to what vLLM counted
        (``used``; None: the estimate stands). Off the request path."""
        correction = used - a.estimate if used is not None and a.tenant.tpm else 0
        if a.local:
            share = self._shares.get(a.tenant.name)
            if share is not None:
                share.running.discard(a.member)
                if share.minute == a.minute:
                    share.tokens += correction
            return
        if self._link is None:
            return
        key = self._prefix + a.tenant.name
        commands: list[tuple[object, ...]] = []
        if a.tenant.max_concurrent:
            commands.append(("ZREM", f"{key}:c", a.member))
        if correction:
            commands.append(("INCRBY", f"{key}:t:{a.minute}", correction))
        if commands:
            self._link.soon(*commands)
