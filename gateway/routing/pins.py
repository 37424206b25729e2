"""Session pins in Redis, through the process's ``RedisLink`` (never fatal, never slow).

When Redis can't answer, every call returns ``answered=False`` at once and callers fall
back to consistent hashing meanwhile.
"""

from __future__ import annotations

from gateway.state.link import RedisLink, text


class PinStore:
    def __init__(self, link: RedisLink, ttl: float) -> None:
        self._link = link
        self._prefix = link.prefix + "pin:"
        self._ttl_ms = int(ttl * 1000)

    @property
    def up(self) -> bool:
        return self._link.up

    async def claim(self, session: str, backend: str) -> tuple[bool, str | None]:
        """Pin ``session`` to ``backend`` unless pinned already, and refresh the pin's TTL.

        Returns (answered, existing pin); (True, None) means our claim won. One round trip,
        shared with every other request of this loop turn."""
        return await self._link.claim(self._prefix + session, backend, self._ttl_ms)

    async def get(self, session: str) -> tuple[bool, str | None]:
        """The session's pin, its TTL refreshed in the same round trip (GETEX)."""
        answered, results = await self._link.execute(
            ("GETEX", self._prefix + session, "PX", self._ttl_ms))
        if not answered or isinstance(results[0], Exception):
            return False, None
        return True, text(results[0])

    async def repin(self, session: str, backend: str) -> bool:
        answered, _ = await self._link.execute(
            ("SET", self._prefix + session, backend, "PX", self._ttl_ms))
        return answered

