"""Session pins in Redis: every call async, bounded by a short timeout, never fatal.

When Redis fails, the store reports itself unavailable (one log line per outage), answers
None at once for ``retry_interval`` seconds, then tries again: callers fall back to
consistent hashing meanwhile and nothing waits on a dead server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.metrics import Metrics

log = logging.getLogger("gateway.store")


class PinStore:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl: float, retry_interval: float,
                 metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._prefix = prefix + "pin:"
        self._ttl_ms = int(ttl * 1000)
        self._retry_interval = retry_interval
        self._metrics = metrics
        self._clock = clock
        self._down_until = 0.0
        self.up = True
        metrics.redis_up.set(1)

    @property
    def available(self) -> bool:
        return self.up or self._clock() >= self._down_until

    async def claim(self, session: str, backend: str) -> tuple[bool, str | None]:
        """Pin ``session`` to ``backend`` unless pinned already.

        Returns (answered, existing pin); (True, None) means our claim won. One round trip:
        ``SET key value NX GET PX ttl``.
        """
        answered, value = await self._call(lambda: self._client.set(
            self._prefix + session, backend, nx=True, get=True, px=self._ttl_ms))
        return answered, _text(value)

    async def get(self, session: str) -> tuple[bool, str | None]:
        """The session's pin, its TTL refreshed in the same round trip (GETEX)."""
        answered, value = await self._call(lambda: self._client.getex(self._prefix + session,
                                                                       px=self._ttl_ms))
        return answered, _text(value)

    async def repin(self, session: str, backend: str) -> bool:
        answered, _ = await self._call(lambda: self._client.set(
            self._prefix + session, backend, px=self._ttl_ms))
        return answered

    async def _call(self, op: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        if not self.available:
            return False, None
        started = self._clock()
        try:
            result = await op()
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.redis_errors.inc()
            self._down_until = self._clock() + self._retry_interval
            if self.up:
                self.up = False
                self._metrics.redis_up.set(0)
                log.warning("redis unavailable (%s): routing sessions by consistent hashing "
                            "until it answers again", type(exc).__name__)
            return False, None
        self._metrics.redis_latency.observe(self._clock() - started)
        if not self.up:
            self.up = True
            self._metrics.redis_up.set(1)
            log.warning("redis answers again: session pins restored")
        return True, result

    async def aclose(self) -> None:
        await self._client.aclose()


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None
