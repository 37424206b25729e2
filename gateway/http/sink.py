"""The client's connection reached directly, when uvicorn serves it.

``Hangup``: the request's task is cancelled when its client hangs up, by a callback from
the connection (``gateway.http.server.Guarded`` puts itself in the scope's extensions)
instead of a watcher task per request waiting for ``http.disconnect``.

``Sink``: a stream's body written straight to the client's connection. uvicorn's ASGI
``send`` costs a coroutine, a message dict and its checks for every chunk. When the
``send`` a relay holds is uvicorn's own (no middleware wrapped it) and the reply is chunked,
each chunk is framed and written to the transport here, exactly as that ``send`` would; the
reply's start and its end still go through ``send``, so uvicorn's view of the response
stays its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from backends.asgi import cancel_on_disconnect

CONNECTION = "vllm_gateway.connection"  # the scope's extension: the serving protocol


def close_lingering(scope: Scope) -> None:
    """The reply about to be sent closes the connection before the client's body was read
    (413, 408): read and drop the rest first, so that a client still writing gets the reply
    instead of a reset (``gateway.http.server.Guarded.linger``)."""
    connection = scope.get("extensions", {}).get(CONNECTION)
    if connection is not None:
        connection.linger()


class Hangup:
    """Cancels the calling task when the client hangs up before the response ended; the
    caller calls ``cancel`` when it is done. ``done()`` tells whether the client left."""

    __slots__ = ("_conn", "_owner", "_task", "happened")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        owner = asyncio.current_task()
        assert owner is not None
        self._owner = owner
        self.happened = False
        self._conn = scope.get("extensions", {}).get(CONNECTION)
        self._task: asyncio.Task[None] | None = None
        if self._conn is not None:
            self._conn.on_hangup(self._fire)
        else:  # another server: wait for its http.disconnect
            self._task = cancel_on_disconnect(receive)

    def _fire(self) -> None:
        self.happened = True
        self._owner.cancel("client disconnected")

    def done(self) -> bool:
        return self.happened or (self._task is not None and self._task.done())

    def cancel(self) -> None:
        if self._conn is not None:
            self._conn.on_hangup(None)
        elif self._task is not None:
            self._task.cancel()


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

    def relay(self, tap: Callable[[bytes], object]) -> Callable[[bytes], bool]:
        """What the backend connection calls with each chunk: the chunk sent, then ``tap``
        told; True when the client's buffer is full (pause until ``drained``)."""
        cycle, write, flow = self._cycle, self._transport.write, self._flow

        def forward(chunk: bytes) -> bool:
            if not cycle.disconnected:
                write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            tap(chunk)
            return flow.write_paused

        return forward

    async def drained(self) -> None:
        await self._flow.drain()
