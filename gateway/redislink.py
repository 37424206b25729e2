"""One Redis connection for the whole process: every call async, bounded, never fatal.

When Redis fails, the link reports itself unavailable (one log line per outage), answers
at once without trying for ``retry_interval`` seconds, then tries again. Pins, breaker
sharing and the reply cache all go through it, so an outage is seen (and logged) once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.metrics import Metrics

log = logging.getLogger("gateway.redis")


class RedisLink:
    def __init__(self, client: aioredis.Redis, prefix: str, retry_interval: float,
                 metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.prefix = prefix
        self._retry_interval = retry_interval
        self._metrics = metrics
        self._clock = clock
        self._down_until = 0.0
        self.up = True
        metrics.redis_up.set(1)

    @property
    def available(self) -> bool:
        return self.up or self._clock() >= self._down_until

    async def call(self, op: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """Run ``op`` against Redis: (True, result), or (False, None) when Redis can't answer."""
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
                log.warning("redis unavailable (%s): pins fall back to consistent hashing, "
                            "breakers to local state, until it answers again",
                            type(exc).__name__)
            return False, None
        self._metrics.redis_latency.observe(self._clock() - started)
        if not self.up:
            self.up = True
            self._metrics.redis_up.set(1)
            log.warning("redis answers again: shared state restored")
        return True, result

    async def aclose(self) -> None:
        await self.client.aclose()

    def __repr__(self) -> str:
        return f"<RedisLink [{'up' if self.up else 'down'}]>"
