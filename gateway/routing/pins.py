"""Session state in Redis, through the process's ``RedisLink`` (never fatal, never slow):
which backend a session is pinned to (``pin:MODEL:SESSION``) and which canary arm it is in
(``arm:MODEL:SESSION``), each kept ``ttl`` seconds after its last use.

A request asks both in the one round trip it makes before it is forwarded: its pin is
claimed (``claim``: a script that answers the pin, or, for a new session, pins it to the
next of its candidates in a turn order kept per model in Redis, so that concurrent first
requests of a session on any process agree and new sessions take turns across the whole
deployment while pinned ones take none), its arm read (``read``), both TTLs refreshed.
What it decides from them later (a session moved, an arm first stored) is written off its
path (``keep``). When Redis can't answer, callers fall back to consistent hashing meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gateway.state.link import Command, RedisLink, text

# A session's pin, or a new one: the next of the candidates in turn (the turn kept per model
# in Redis, taken only by new sessions). Answers the pin it had, or {the new pin}.
CLAIM = """
local held = redis.call('GET', KEYS[1])
if held then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return held
end
local n = #ARGV - 1
if n < 1 then return false end
local turn = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
local pin = ARGV[2 + (turn - 1) % n]
redis.call('SET', KEYS[1], pin, 'PX', ARGV[1])
return {pin}
"""


class PinStore:
    def __init__(self, link: RedisLink, ttl: float, kind: str = "pin") -> None:
        self._link = link
        self._prefix = f"{link.prefix}{kind}:"
        self._turns = f"{link.prefix}turn:"
        self._ttl_ms = int(ttl * 1000)

    def claim(self, model: str, session: str, turns: Sequence[str]) -> Command:
        """The script that answers ``session``'s pin (its TTL refreshed), or pins it to the
        next of ``turns`` (the candidates a new session may go to, in their turn order,
        each as often as its weight) and answers that in a list."""
        return ("EVAL", CLAIM, 2, self._prefix + session, self._turns + model, self._ttl_ms,
                *turns)

    @staticmethod
    def answer(result: object) -> tuple[str | None, bool]:
        """The claim's answer: (the session's pin, whether it is new)."""
        if isinstance(result, list):
            return (text(result[0]) if result else None), True
        return text(result), False

    def behind(self, model: str, session: str, value: str, made: Callable[[], None],
               still: Callable[[], bool]) -> None:
        """Pin ``session`` to ``value`` off the caller's path, over any pin it had while
        ``still()`` holds (the request did not move since); ``made`` is called when the
        session had none (a new one)."""
        def answered(ok: bool, results: list[Any]) -> None:
            if not ok or not results or isinstance(results[0], Exception):
                return
            pin, new = self.answer(results[0])
            if new:
                made()
            elif pin != value and still():
                self.keep(session, value, new=False)
        self._link.soon(self.claim(model, session, (value,)), then=answered)

    def read(self, session: str) -> Command:
        """The command that reads ``session``'s value and refreshes its TTL (GETEX)."""
        return ("GETEX", self._prefix + session, "PX", self._ttl_ms)

    def keep(self, session: str, value: str, new: bool) -> None:
        """Store ``session``'s value off the caller's path: ``new`` only if it has none yet
        (another process may have just stored one), else over the one it had."""
        nx = ("NX",) if new else ()
        self._link.soon(("SET", self._prefix + session, value, *nx, "PX", self._ttl_ms))
