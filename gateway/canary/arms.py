"""Canary arms: which group a request goes to, and sessions that keep theirs.

A request without a session is drawn by weight; a session's first arm is a hash of it
against the weight (so without Redis every process puts it in the same arm while the
weights stay) and is then stored beside its pin (``arm:MODEL:SESSION``, a ``PinStore`` of
kind "arm"), read with the pin in the request's one round trip and refreshed on use, so it
keeps that arm when the weights change, until its arm's weight drops to zero.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.canary.rollout import Canary
from gateway.routing.pins import PinStore
from gateway.routing.pool import BackendPool
from gateway.types import Facts, Record


class Arms:
    """Puts each request in an arm (``Record.group``) while a rollout is on."""

    def __init__(self, pool: BackendPool, canary: Canary, store: PinStore | None = None) -> None:
        self._pool = pool
        self._canary = canary
        self.store = store

    def draw(self, record: Record) -> None:
        """Put the request in a canary arm (``record.group``) drawn by weight (a session's
        by a hash of it, so every process draws the same), before its session's stored arm
        is read (``settle``)."""
        canary, request = self._canary, record.request
        if not canary.enabled:
            return
        if request.session_key is None:
            drawn = canary.draw()
        else:
            drawn = canary.draw_for(f"{request.model}:{request.session_key}")
        if self._pool.known_model(request.model, drawn):
            record.group = drawn
            return
        other = canary.stable if drawn == canary.group else canary.group
        record.group = other if self._pool.known_model(request.model, other) else None

    def settle(self, record: Record, facts: Facts | None) -> None:
        """A session keeps the arm it was first given (``facts.arm``, read with its pin)
        while that arm has weight; what changed is stored off the request's path."""
        canary, request = self._canary, record.request
        drawn = record.group
        if (not canary.enabled or request.session_key is None or self.store is None
                or facts is None or not facts.answered or drawn is None or facts.arm == drawn
                or not self._pool.known_model(request.model, drawn)):
            return
        key = f"{request.model}:{request.session_key}"
        stored = facts.arm
        if stored is None:
            self.store.keep(key, drawn, new=True)
        elif canary.weight_of(stored) > 0 and self._pool.known_model(request.model, stored):
            record.group = stored
        else:  # its arm was removed: the session moves, once, and stays
            self.store.keep(key, drawn, new=False)

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
