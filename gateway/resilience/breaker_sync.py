"""Breaker openings shared between gateway processes through Redis, off the request path.

A process whose breaker opens writes ``<prefix>breaker:<backend> = opened_at`` with the
reset timeout as its TTL; every process reads all keys each ``interval`` and opens its own
breaker with the same deadline. Closing is not shared: each process lets a probe through
of its own once the deadline passes, which costs one request and never spreads a wrong
"healthy". While Redis can't answer, every breaker simply keeps its local state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

import pybreaker

from gateway.resilience.breaker import OPEN, Breakers
from gateway.state.link import RedisLink

log = logging.getLogger("gateway.breaker")


class BreakerSync(pybreaker.CircuitBreakerListener):
    def __init__(self, link: RedisLink, breakers: Breakers, reset_timeout: float,
                 interval: float) -> None:
        self._link = link
        self._breakers = breakers
        self._prefix = link.prefix + "breaker:"
        self._reset_timeout = reset_timeout
        self._interval = interval
        self._pending: dict[str, datetime] = {}  # local openings not written yet
        breakers.add_listener(self)

    def state_change(self, cb: pybreaker.CircuitBreaker,
                     old_state: pybreaker.CircuitBreakerState | None,
                     new_state: pybreaker.CircuitBreakerState) -> None:
        breaker = self._breakers.by_name.get(cb.name or "")
        if breaker is None or breaker.remote or new_state.name != OPEN:
            return
        self._pending[breaker.name] = breaker.opened_at or datetime.now(UTC)

    async def run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self._interval)

    async def sync_once(self) -> None:
        await self._push()
        names = list(self._breakers.by_name)
        answered, values = await self._link.call(
            lambda: self._link.client.mget([self._prefix + n for n in names]))
        if not answered:
            return
        for name, value in zip(names, values, strict=True):
            if value:
                with contextlib.suppress(ValueError):
                    opened = datetime.fromtimestamp(float(value), UTC)
                    self._breakers.by_name[name].open_from_remote(opened)

    async def _push(self) -> None:
        now = datetime.now(UTC)
        for name, opened in list(self._pending.items()):
            ttl_ms = int((self._reset_timeout - (now - opened).total_seconds()) * 1000)
            if ttl_ms <= 0:
                self._pending.pop(name, None)
                continue
            key, value = self._prefix + name, repr(opened.timestamp())
            answered, _ = await self._link.call(
                lambda: self._link.client.set(key, value, px=ttl_ms))  # noqa: B023
            if not answered:
                return  # Redis is away: keep the rest for the next round
            self._pending.pop(name, None)
