"""Session pins in Redis, through the process's ``RedisLink`` (never fatal, never slow).

When Redis can't answer, every call returns ``answered=False`` at once and callers fall
back to consistent hashing meanwhile.
"""

from __future__ import annotations

from typing import Any

from gateway.redislink import RedisLink


class PinStore:
    def __init__(self, link: RedisLink, ttl: float) -> None:
        self._link = link
        self._client = link.client
        self._prefix = link.prefix + "pin:"
        self._ttl_ms = int(ttl * 1000)

    @property
    def up(self) -> bool:
        return self._link.up

    async def claim(self, session: str, backend: str) -> tuple[bool, str | None]:
        """Pin ``session`` to ``backend`` unless pinned already.

        Returns (answered, existing pin); (True, None) means our claim won. One round trip:
        ``SET key value NX GET PX ttl``.
        """
        answered, value = await self._link.call(lambda: self._client.set(
            self._prefix + session, backend, nx=True, get=True, px=self._ttl_ms))
        return answered, _text(value)

    async def get(self, session: str) -> tuple[bool, str | None]:
        """The session's pin, its TTL refreshed in the same round trip (GETEX)."""
        answered, value = await self._link.call(lambda: self._client.getex(
            self._prefix + session, px=self._ttl_ms))
        return answered, _text(value)

    async def repin(self, session: str, backend: str) -> bool:
        answered, _ = await self._link.call(lambda: self._client.set(
            self._prefix + session, backend, px=self._ttl_ms))
        return answered


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None
