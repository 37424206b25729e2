"""Canary arms: which group a request goes to, and sessions that keep theirs.

A request without a session is drawn by weight; a session's first arm is a hash of it
against the weight (so without Redis every process puts it in the same arm while the
weights stay) and is then stored beside its pin (``arm:MODEL:SESSION``), claimed once with
SET NX and refreshed on use, so it keeps that arm when the weights change, until its arm's
weight drops to zero.
"""

from __future__ import annotations

from typing import Any

from gateway.canary.rollout import Canary
from gateway.routing.pool import BackendPool
from gateway.state.link import RedisLink
from gateway.types import RequestContext


class ArmStore:
    """Which arm a session is in, kept in Redis for ``ttl`` seconds after its last use."""

    def __init__(self, link: RedisLink, ttl: float) -> None:
        self._link = link
        self._prefix = link.prefix + "arm:"
        self._ttl_ms = int(ttl * 1000)

    async def claim(self, key: str, drawn: str) -> tuple[bool, str | None]:
        """(answered, the session's arm before this call); None means ``drawn`` was stored."""
        client, full = self._link.client, self._prefix + key

        async def op() -> Any:
            pipe = client.pipeline(transaction=False)
            pipe.set(full, drawn, nx=True, get=True, px=self._ttl_ms)
            pipe.pexpire(full, self._ttl_ms)
            return await pipe.execute()

        answered, result = await self._link.call(op)
        return answered, (result[0] if answered else None)

    async def move(self, key: str, arm: str) -> None:
        client = self._link.client
        await self._link.call(lambda: client.set(self._prefix + key, arm, px=self._ttl_ms))


class Arms:
    """Puts each request in an arm (``ctx.group``) while a rollout is on."""

    def __init__(self, pool: BackendPool, canary: Canary, store: ArmStore | None = None) -> None:
        self._pool = pool
        self._canary = canary
        self.store = store  # set once Redis is up

    async def assign(self, ctx: RequestContext) -> None:
        """Put the request in a canary arm (``ctx.group``): a session keeps the arm it was
        first given while that arm has weight; other requests are drawn by weight."""
        canary = self._canary
        if not canary.enabled:
            return
        if ctx.session_key is None:
            drawn = canary.draw()
        else:
            drawn = canary.draw_for(f"{ctx.model}:{ctx.session_key}")
        if not self._pool.known_model(ctx.model, drawn):
            other = canary.stable if drawn == canary.group else canary.group
            ctx.group = other if self._pool.known_model(ctx.model, other) else None
            return
        ctx.group = drawn
        if ctx.session_key is None or self.store is None:
            return
        key = f"{ctx.model}:{ctx.session_key}"
        answered, stored = await self.store.claim(key, drawn)
        if not answered or stored is None or stored == drawn:
            return
        if canary.weight_of(stored) > 0 and self._pool.known_model(ctx.model, stored):
            ctx.group = stored
        else:  # its arm was removed: the session moves, once, and stays
            await self.store.move(key, drawn)
