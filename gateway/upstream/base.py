"""What the proxy needs from an HTTP client, and the errors it may raise."""

from __future__ import annotations

from typing import Protocol

Headers = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The HTTP client failed; the library's own exception is the ``__cause__``."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing reached the backend, so another may be tried."""


class UpstreamBroken(UpstreamError):
    """The backend dropped the connection or sent something unreadable."""


class ErrorTable:
    """A client library's exceptions and the UpstreamError each becomes, the most specific
    first (httpcore's ``map_exceptions``). Translated only in an ``except`` clause, so the
    per-chunk read costs nothing until something fails:

        except table.caught as exc:
            raise table.translate(exc) from exc
    """

    __slots__ = ("caught", "rows")

    def __init__(self, *rows: tuple[type[Exception], type[UpstreamError]]) -> None:
        self.rows = rows
        self.caught = tuple(library for library, _ in rows)

    def translate(self, exc: Exception) -> UpstreamError:
        ours = next((o for library, o in self.rows if isinstance(exc, library)), UpstreamBroken)
        return ours(str(exc) or type(exc).__name__)


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
