"""A stream's body written straight to the client's connection.

uvicorn's ASGI ``send`` costs a coroutine, a message dict and its checks for every chunk.
When the ``send`` a relay holds is uvicorn's own (no middleware wrapped it) and the reply
is chunked, each chunk is framed and written to the transport here, exactly as that
``send`` would; the reply's start and its end still go through ``send``, so uvicorn's
view of the response stays its own.
"""

from __future__ import annotations

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class Sink:
    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    @staticmethod
    def of(send: Send) -> Sink | None:
        """The sink behind ``send`` once the reply started chunked, or None (the relay then
        sends through ``send``)."""
        cycle = getattr(send, "__self__", None)
        if (type(cycle) is not RequestResponseCycle or cycle.chunked_encoding is not True
                or cycle.response_complete or cycle.scope["method"] == "HEAD"):
            return None
        return Sink(cycle)

    def write(self, chunk: bytes) -> bool:
        """Send one chunk; True when the client's buffer is full (pause until ``drained``)."""
        if self._cycle.disconnected:
            return False
        self._transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        return self._flow.write_paused

    async def drained(self) -> None:
        await self._flow.drain()
