"""RESP on an asyncio protocol, for the link's shared pipelines.

redis-py spent ~120 µs of CPU on a pipeline of two commands (a pipeline object, a
connection checked out of its pool and back, a task and a wait for the deadline): more than
the rest of a non-streaming request. Here a batch is packed by hand and written in one
call, its replies parsed by hiredis (the C parser redis-py itself uses) as they arrive and
handed to one future. Batches are pipelined on one connection, in order. A TLS URL stays
with redis-py (``lean_params`` says which).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection

Command = tuple[Any, ...]


def lean_params(client: aioredis.Redis) -> dict[str, Any] | None:
    """Where and how to connect, as the client was configured; None for a TLS (or any
    other kind of) connection, which stays with redis-py."""
    pool = client.connection_pool
    if pool.connection_class not in (Connection, UnixDomainSocketConnection):
        return None
    return dict(pool.connection_kwargs)


def pack(commands: Sequence[Command]) -> list[bytes]:
    """Commands in RESP, as parts to write (a large value is not copied)."""
    out: list[bytes] = []
    for args in commands:
        out.append(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int | float):
                arg = repr(arg).encode()
            out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return out


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        # Each batch sent and not yet answered: [replies expected, replies so far, future].
        self._pending: deque[tuple[int, list[Any], asyncio.Future[list[Any]]]] = deque()
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        pending = self._pending
        while pending:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self.close(ConnectionError(f"unreadable reply from redis: {exc}"))
                return
            if reply is False:
                return
            count, replies, future = pending[0]
            replies.append(reply)
            if len(replies) == count:
                pending.popleft()
                if not future.done():
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("redis closed the connection")
        while self._pending:
            future = self._pending.popleft()[2]
            if not future.done():
                future.set_exception(self.lost)

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if self.lost is not None or self.transport is None:
            future.set_exception(self.lost or ConnectionError("not connected"))
            return future
        self._pending.append((len(commands), [], future))
        self.transport.writelines(pack(commands))
        return future

    def close(self, why: Exception) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(why)


class Resp:
    """One connection, made when first needed and again after it failed."""

    def __init__(self, params: dict[str, Any]) -> None:
        self._params = params
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.lost is None

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """The batch written; its future has the replies (an error reply as an exception
        instance) or the connection's failure. Not connected (another batch's overdue
        reply dropped the connection while this one waited for it): a ConnectionError."""
        if self._conn is None:
            future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            future.set_exception(ConnectionError("not connected"))
            return future
        return self._conn.send(commands)

    async def connect(self) -> _Protocol:
        connecting = self._connecting
        if connecting is None:  # one connection for every batch that waits for it
            connecting = self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop, p = asyncio.get_running_loop(), self._params
        if "path" in p:
            _, conn = await loop.create_unix_connection(_Protocol, p["path"])
        else:
            _, conn = await loop.create_connection(_Protocol, p.get("host", "localhost"),
                                                   p.get("port", 6379))
        hello: list[Command] = []
        if p.get("password"):
            user = p.get("username")
            hello.append(("AUTH", user, p["password"]) if user else ("AUTH", p["password"]))
        if p.get("db"):
            hello.append(("SELECT", p["db"]))
        if hello:
            failed = [r for r in await conn.send(hello) if isinstance(r, Exception)]
            if failed:
                conn.close(ConnectionError(str(failed[0])))
                raise failed[0]
        self._conn = conn
        return conn

    def drop(self, why: Exception) -> None:
        """Give up on the connection (a reply overdue: every later one would be late too)."""
        if self._conn is not None:
            self._conn.close(why)
            self._conn = None

    async def aclose(self) -> None:
        self.drop(ConnectionError("closed"))
