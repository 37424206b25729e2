"""What the proxy needs from an HTTP client, and the errors it may raise."""

from __future__ import annotations

from typing import Protocol

Headers = list[tuple[bytes, bytes]]


class ConnectFailed(Exception):
    """No connection could be made: nothing reached the backend, so another may be tried."""


class UpstreamBroken(Exception):
    """The backend dropped the connection or sent something unreadable."""


class UpstreamResponse(Protocol):
    status: int
    headers: Headers

    async def read(self) -> bytes:
        """The next body bytes exactly as they arrived; b"" at the end.

        Raises UpstreamBroken on a dropped connection."""
        ...

    async def aclose(self, reuse: bool) -> None:
        """Finish with the response; ``reuse=False`` closes the connection (the backend sees
        the hang-up and aborts the generation)."""
        ...


class Upstream(Protocol):
    async def request(
        self, method: str, url: str, headers: Headers, body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once the response headers are in."""
        ...

    async def aclose(self) -> None: ...
