"""Canary arms: which group a request goes to, and sessions that keep theirs.

A request without a session is drawn by weight; a session's first arm is a hash of it
against the weight (so without Redis every process puts it in the same arm while the
weights stay) and is then stored beside its pin (``arm:MODEL:SESSION``), claimed once with
SET NX and refreshed on use, so it keeps that arm when the weights change, until its arm's
weight drops to zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.canary.rollout import Canary
from gateway.routing.pool import BackendPool
from gateway.state.link import RedisLink
from gateway.types import Record


class ArmStore:
    """Which arm a session is in, kept in Redis for ``ttl`` seconds after its last use."""

    def __init__(self, link: RedisLink, ttl: float) -> None:
        self._link = link
        self._prefix = link.prefix + "arm:"
        self._ttl_ms = int(ttl * 1000)

    async def claim(self, key: str, drawn: str) -> tuple[bool, str | None]:
        """(answered, the session's arm before this call); None means ``drawn`` was stored.
        One round trip, shared with the request's pin claim."""
        return await self._link.claim(self._prefix + key, drawn, self._ttl_ms)

    async def move(self, key: str, arm: str) -> None:
        await self._link.execute(("SET", self._prefix + key, arm, "PX", self._ttl_ms))


class Arms:
    """Puts each request in an arm (``Record.group``) while a rollout is on."""

    def __init__(self, pool: BackendPool, canary: Canary, store: ArmStore | None = None) -> None:
        self._pool = pool
        self._canary = canary
        self.store = store

    def assign(self, record: Record) -> asyncio.Task[None] | None:
        """Put the request in a canary arm (``record.group``): a session keeps the arm it
        was first given while that arm has weight; other requests are drawn by weight.

        The drawn arm is set at once; for a session, the stored arm is checked by the task
        returned, which the caller awaits after starting its pin lookup, so that both go
        to Redis in one round trip. The task may change ``record.group``."""
        canary, request = self._canary, record.request
        if not canary.enabled:
            return None
        if request.session_key is None:
            drawn = canary.draw()
        else:
            drawn = canary.draw_for(f"{request.model}:{request.session_key}")
        if not self._pool.known_model(request.model, drawn):
            other = canary.stable if drawn == canary.group else canary.group
            record.group = other if self._pool.known_model(request.model, other) else None
            return None
        record.group = drawn
        if request.session_key is None or self.store is None:
            return None
        return asyncio.ensure_future(self._confirm(record, self.store, drawn))

    def to_stable(self, record: Record, serves: Callable[[str], bool]) -> bool:
        """The request's canary arm has no backend left to take it (all down, or tried):
        the stable group does, when ``serves`` it. This request only: the session keeps its
        arm and its pin (stable's backend is hashed from the session meanwhile), and goes
        back to the canary once it serves again."""
        canary = self._canary
        if not canary.enabled or record.group != canary.group or not serves(canary.stable):
            return False
        record.group, record.outside_arm = canary.stable, True  # its pin stays the canary's
        record.note = record.note or "canary unavailable: stable served"
        return True

    async def _confirm(self, record: Record, store: ArmStore, drawn: str) -> None:
        request = record.request
        key = f"{request.model}:{request.session_key}"
        answered, stored = await store.claim(key, drawn)
        if not answered or stored is None or stored == drawn:
            return
        if self._canary.weight_of(stored) > 0 and self._pool.known_model(request.model, stored):
            record.group = stored
        else:  # its arm was removed: the session moves, once, and stays
            await store.move(key, drawn)
