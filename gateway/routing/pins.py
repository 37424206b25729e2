"""Session state in Redis, through the process's ``RedisLink`` (never fatal, never slow):
which backend a session is pinned to (``pin:MODEL:SESSION``) and which canary arm it is in
(``arm:MODEL:SESSION``), each kept ``ttl`` seconds after its last use.

A request asks both in the one round trip it makes before it is forwarded: its pin is
claimed (``claim``: the backend proposed for a new session is stored unless the session has
one, atomically, so concurrent first requests of a session on any process agree), its arm
read (``read``), both TTLs refreshed. What it decides from them later (a session moved, an
arm first stored) is written off its path (``keep``). When Redis can't answer, callers
fall back to consistent hashing meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.state.link import Command, RedisLink, text


class PinStore:
    def __init__(self, link: RedisLink, ttl: float, kind: str = "pin") -> None:
        self._link = link
        self._prefix = f"{link.prefix}{kind}:"
        self._ttl_ms = int(ttl * 1000)

    def claim(self, session: str, proposed: str) -> tuple[Command, Command]:
        """The commands that store ``proposed`` unless ``session`` has a value, and answer
        the value it had (None: ``proposed`` was stored), its TTL refreshed either way."""
        key = self._prefix + session
        return (("SET", key, proposed, "NX", "GET", "PX", self._ttl_ms, {"get": True}),
                ("PEXPIRE", key, self._ttl_ms))

    def behind(self, session: str, value: str, made: Callable[[], None]) -> None:
        """Pin ``session`` to ``value`` off the caller's path, over any pin it had; ``made``
        is called when it had none (a new session)."""
        def answered(ok: bool, results: list[Any]) -> None:
            if ok and results and results[0] is None:
                made()
            elif ok and results and text(results[0]) != value:
                self.keep(session, value, new=False)
        self._link.soon(*self.claim(session, value), then=answered)

    def read(self, session: str) -> Command:
        """The command that reads ``session``'s value and refreshes its TTL (GETEX)."""
        return ("GETEX", self._prefix + session, "PX", self._ttl_ms)

    def keep(self, session: str, value: str, new: bool) -> None:
        """Store ``session``'s value off the caller's path: ``new`` only if it has none yet
        (another process may have just stored one), else over the one it had."""
        nx = ("NX",) if new else ()
        self._link.soon(("SET", self._prefix + session, value, *nx, "PX", self._ttl_ms))
