"""Everything a request needs to know from Redis, asked in one round trip before it is
routed: its key's limits (checked and taken by one script), where the stored response it
names lives, its session's pin and its canary arm. Each owner writes its own command and
judges its own answer; nothing is asked again while the request runs."""

from __future__ import annotations

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
                       proposed: str | None, sole: bool = False) -> tuple[Facts, Backend | None]:
        """The session's facts and the backend holding the stored response the request
        names (None: any may take it), once its key's limits let it through; their
        refusal, or a stored response that can't be found, is raised. ``proposed``: the
        backend a new session would be pinned to (claimed unless it has one); ``sole``: it
        is the only backend that could take the request now, so when nothing else must be
        asked the request goes without waiting for Redis, and the session is pinned there
        off its path (in a burst, a session's request otherwise reaches vLLM behind every
        request without one: docs/BENCHMARKS.md, issue 37's GPU burst)."""
        request = record.request
        if (sole and proposed is not None and admission is None and request.follows is None
                and self._pins is not None and not self._canary.enabled
                and request.session_key is not None and self._link is not None
                and self._link.available):
            self._pins.behind(f"{request.model}:{request.session_key}", proposed,
                              lambda: self._made(proposed))
            return Facts(True, proposed, unread="sole"), None
        asks: list[Command] = []
        if admission is not None:
            asks.append(self._gate.command(admission))
        follows = request.follows if self._responses.enabled else None
        if follows is not None:
            asks.append(self._responses.command(follows))
        session = (f"{request.model}:{request.session_key}"
                   if request.session_key is not None and request.model else None)
        pins = self._pins if session is not None and proposed is not None else None
        arms = self._arms if session is not None and self._canary.enabled else None
        if pins is not None:
            asks.extend(pins.claim(session or "", proposed or ""))
        if arms is not None:
            asks.append(arms.read(session or ""))
        answered, results = False, list[object]()
        if asks and self._link is not None:
            answered, results = await self._link.execute(*asks)
        told = iter(results)
        if admission is not None:
            self._gate.admit(record, admission, answered, next(told, None))
        only = (self._responses.where(follows, not request.model, answered, next(told, None))
                if follows is not None else None)
        held = (next(told, None), next(told, None))[0] if pins is not None else None
        arm = next(told, None) if arms is not None else None
        failed = isinstance(held, Exception) or isinstance(arm, Exception)
        pin = text(held)
        return Facts(answered and not failed, pin or proposed, pin is None,
                     arm=text(arm)), only
