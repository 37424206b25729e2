"""The canary across gateway processes: one state, one set of statistics, one analyst.

Every ``interval`` each process (1) reads ``canary:state`` and adopts a newer one, or
writes its own when it is newer (an operator's change made here); (2) adds what it saw
since the last round to the step's shared windows (``canary:win:VERSION:GROUP`` hashes);
(3) if it holds the short ``canary:leader`` lease, judges the shared windows and writes
the decision. Every process therefore applies an operator's change or a decision within
about one interval. While Redis can't answer, each process keeps deciding alone.

Session arms live beside the pins (``arm:MODEL:SESSION``): claimed once with SET NX,
refreshed on use, and reassigned only when their arm's weight drops to zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import orjson

from gateway.canary.rollout import Canary, CanaryState, Window
from gateway.state.link import RedisLink

log = logging.getLogger("gateway.canary")


class CanarySync:
    def __init__(self, link: RedisLink, canary: Canary) -> None:
        self._link = link
        self._canary = canary
        self._prefix = link.prefix + "canary:"
        self._me = f"{os.getpid()}-{os.urandom(4).hex()}"

    @property
    def _interval(self) -> float:
        return self._canary.settings.sync_interval  # a reload may change it

    async def run(self) -> None:
        while True:  # started whenever Redis is: a reload may turn the canary on
            if self._canary.enabled:
                await self.sync_once()
            await asyncio.sleep(self._interval)

    async def sync_once(self) -> None:
        if not await self._share_state():
            self._canary.decide(*self._local())  # Redis away: decide from what we saw
            return
        await self._flush()
        if await self._lead():
            windows = await self._windows()
            if windows is not None:
                decided = self._canary.decide(*windows)
                if decided is not None:
                    await self.publish(decided)

    async def publish(self, state: CanaryState) -> bool:
        """Write ``state`` for every process (an operator's change, or a decision)."""
        client = self._link.client
        answered, _ = await self._link.call(
            lambda: client.set(self._prefix + "state", orjson.dumps(state.to_dict())))
        return answered

    async def _share_state(self) -> bool:
        client = self._link.client
        answered, raw = await self._link.call(lambda: client.get(self._prefix + "state"))
        if not answered:
            return False
        canary = self._canary
        if raw:
            try:
                remote = CanaryState.from_dict(orjson.loads(raw))
            except (orjson.JSONDecodeError, TypeError, ValueError):
                remote = None
            if remote is not None and canary.adopt(remote, shared=True):
                return True
            if remote is not None and remote.version >= canary.state.version:
                return True
        return await self.publish(canary.state)

    async def _flush(self) -> None:
        pending, self._canary.pending = self._canary.pending, {}
        if not pending:
            return
        version = self._canary.state.version
        client = self._link.client

        async def write() -> Any:
            pipe = client.pipeline(transaction=False)
            for group, window in pending.items():
                key = f"{self._prefix}win:{version}:{group}"
                for name, value in window.as_fields().items():
                    if value:
                        pipe.hincrby(key, name, value)
                pipe.expire(key, 86400)
            return await pipe.execute()

        await self._link.call(write)

    async def _lead(self) -> bool:
        client, key = self._link.client, self._prefix + "leader"
        ttl = max(1, int(self._interval * 4 * 1000))
        answered, won = await self._link.call(
            lambda: client.set(key, self._me, nx=True, px=ttl))
        if answered and won:
            return True
        answered, holder = await self._link.call(lambda: client.get(key))
        if answered and holder == self._me:
            await self._link.call(lambda: client.pexpire(key, ttl))
            return True
        return False

    async def _windows(self) -> tuple[Window, Window] | None:
        canary, client = self._canary, self._link.client
        base = f"{self._prefix}win:{canary.state.version}:"

        async def read() -> Any:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(base + canary.stable)
            pipe.hgetall(base + canary.group)
            return await pipe.execute()

        answered, result = await self._link.call(read)
        if not answered:
            return None
        return Window.from_fields(result[0]), Window.from_fields(result[1])

    def _local(self) -> tuple[Window, Window]:
        w = self._canary.windows
        return w.get(self._canary.stable, Window()), w.get(self._canary.group, Window())
