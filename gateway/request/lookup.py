"""Everything a request needs to know from Redis, asked in one round trip before it is
routed: its key's limits (checked and taken by one script), where the stored response it
names lives, its session's pin and its canary arm. Each owner writes its own command and
judges its own answer; nothing is asked again while the request runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from backends.backend import Backend
from gateway.canary.rollout import Canary
from gateway.routing.pins import PinStore
from gateway.routing.responses import ResponsePins
from gateway.state.link import Command, RedisLink, text
from gateway.tenants.gate import TenantGate
from gateway.tenants.limits import Admission
from gateway.types import Facts, Record


class Lookup:
    def __init__(self, link: RedisLink | None, pins: PinStore | None, arms: PinStore | None,
                 canary: Canary, responses: ResponsePins, gate: TenantGate,
                 made: Callable[[str], None] = lambda name: None) -> None:
        self._made = made  # a session pinned here without a lookup turned out new
        self._link = link
        self._pins = pins
        self._arms = arms
        self._canary = canary
        self._responses = responses
        self._gate = gate

    async def __call__(self, record: Record, admission: Admission | None,
                       turns: tuple[str, ...] | None,
                       sole: bool = False) -> tuple[Facts, Backend | None]:
        """The session's facts and the backend holding the stored response the request
        names (None: any may take it), once its key's limits let it through; their
        refusal, or a stored response that can't be found, is raised. ``turns``: where a
        new session may be pinned (the claim takes the next); ``sole``: one backend alone
        could take the request now, so when nothing else must be asked the request goes
        without waiting for Redis, and the session is pinned there off its path (in a
        burst, a session's request otherwise reaches vLLM behind every request without
        one: docs/BENCHMARKS.md, issue 37's GPU burst)."""
        request = record.request
        session = request.session_key
        model = request.model
        if (sole and turns and admission is None and request.follows is None
                and self._pins is not None and not self._canary.enabled
                and session is not None and self._link is not None and self._link.available):
            facts = Facts(True, turns[0], unread="sole")
            self._pins.behind(model, f"{model}:{session}", turns[0],
                              lambda: self._made(turns[0]), lambda: facts.pin == turns[0])
            return facts, None
        asks: list[Command] = []
        if admission is not None:
            asks.append(self._gate.command(admission))
        follows = request.follows if self._responses.enabled else None
        if follows is not None:
            asks.append(self._responses.command(follows))
        key = f"{model}:{session}" if session is not None and model else ""
        pins = self._pins if key and turns is not None else None
        arms = self._arms if key and self._canary.enabled else None
        if pins is not None:  # a follow-up's session is not pinned before it is placed
            asks.append(pins.read(key) if follows is not None else pins.claim(
                model, key, turns or ()))
        if arms is not None:
            asks.append(arms.read(key))
        answered, results = False, list[object]()
        if asks and self._link is not None:
            # A retrieval or cancel has no answer without Redis: it asks even when the link is down
            answered, results = await self._shielded(asks, admission, bool(follows and not model))
        told = iter(results)
        if admission is not None:
            self._gate.admit(record, admission, answered, next(told, None))
        only = (self._responses.where(follows, not model, answered, next(told, None))
                if follows is not None else None)
        held = next(told, None) if pins is not None else None
        arm = next(told, None) if arms is not None else None
        failed = isinstance(held, Exception) or isinstance(arm, Exception)
        pin, new = PinStore.answer(held) if not failed else (None, False)
        return Facts(answered and not failed, pin, new, arm=text(arm)), only

    async def _shielded(self, asks: list[Command], admission: Admission | None,
                        patient: bool) -> tuple[bool, list[object]]:
        """The round trip; a request that leaves while the key's limits are being taken
        gives back what Redis took for it when the answer comes."""
        assert self._link is not None
        if admission is None:
            return await self._link.execute(*asks, patient=patient)
        trip = asyncio.ensure_future(self._link.execute(*asks, patient=patient))
        try:
            return await asyncio.shield(trip)
        except asyncio.CancelledError:
            trip.add_done_callback(lambda done: self._gate.abandon(admission, done))
            raise
