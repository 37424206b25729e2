"""One Redis link for the whole process: every call async, bounded, never fatal.

On the request path, commands are pipelined automatically: every ``execute`` made during
one turn of the event loop goes out in one pipeline, in one round trip, over one of a few
connections (at most ``batches`` pipelines in flight; what arrives meanwhile waits for the
next). A burst of 2,048 requests therefore costs a handful of round trips and connections,
not 2,048 of each (redis-py's pool holds 100 connections and fails past them with
``MaxConnectionsError``). Background loops (breaker and canary sync, reply-cache writes)
use ``call`` with a client call of their own.

Every call is bounded by ``timeout``, measured on the event loop's clock but forgiving of
the loop's own lag: when the deadline passes while the loop is busy (its timer fired late,
or one turn of the loop takes more than a tenth of ``timeout``: a burst of requests being
parsed), the answer may already sit unread in the socket, so the call gets another
``timeout``, for as long as the loop stays busy, up to ``LAG_CAP`` timeouts in all. A hung
Redis on a loop that keeps time fails after ``timeout``. The pipelines go over a RESP
connection of the link's own (``gateway.state.resp``; redis-py for a TLS URL).

When Redis fails, the link reports itself unavailable (one log line per outage), answers
at once without trying for ``retry_interval`` seconds, then tries again. Pins, breaker
sharing and the reply cache all go through it, so an outage is seen (and logged) once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.metrics import Metrics
from gateway.state.resp import Resp, lean_params

log = logging.getLogger("gateway.redis")

Command = tuple[Any, ...]
_Queued = tuple[Sequence[Command], "asyncio.Future[list[Any]]"]
FAILURES = (RedisError, OSError, TimeoutError)
LAG_CAP = 50  # timeouts in all, at most, while the deadline's own timer keeps firing late


def text(value: Any) -> str | None:
    """A string reply as ``str`` (whether or not the client decodes), else None."""
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


async def bounded(awaitable: Awaitable[Any], within: float) -> Any:
    """``await awaitable`` within ``within`` seconds of work by Redis, not of loop lag."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    deadline = loop.time() + within
    try:
        for _ in range(LAG_CAP):
            done, _ = await asyncio.wait((task,), timeout=max(0.0, deadline - loop.time()))
            if done:
                return task.result()
            late = loop.time() - deadline
            turn = loop.time()
            await asyncio.sleep(0)  # how long one turn of the loop takes now
            if task.done():
                return task.result()
            if late < within / 2 and loop.time() - turn < within / 10:
                break  # the loop keeps time: Redis itself is slow
            deadline = loop.time() + within
    except asyncio.CancelledError:
        task.cancel()
        raise
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise TimeoutError(f"redis did not answer within {within:g} s")


class _Watch:
    """A batch's deadline on the lean connection, forgiving the loop's lag as ``bounded``
    does: one timer, armed again when it fired late, or when the loop turn after it took
    more than a tenth of the timeout (a busy loop: the answer may sit unread, or Redis,
    sharing the core, had no time to write it). Overdue, the connection is dropped (every
    later reply on it would be late too), which fails the batch."""

    __slots__ = ("_due", "_future", "_handle", "_loop", "_resp", "_tries", "_within")

    def __init__(self, future: asyncio.Future[Any], resp: Resp, within: float) -> None:
        self._future, self._resp, self._within = future, resp, within
        self._loop = asyncio.get_running_loop()
        self._tries = 0
        self._handle: asyncio.Handle
        self._arm()

    def _arm(self) -> None:
        self._tries += 1
        self._due = self._loop.time() + self._within
        self._handle = self._loop.call_at(self._due, self._check)

    def _check(self) -> None:
        if self._future.done():
            return
        if self._loop.time() - self._due >= self._within / 2 and self._tries < LAG_CAP:
            self._arm()  # the timer fired late: the answer may sit unread in the socket
            return
        self._handle = self._loop.call_soon(self._turn, self._loop.time())

    def _turn(self, began: float) -> None:
        if self._future.done():
            return
        if self._loop.time() - began >= self._within / 10 and self._tries < LAG_CAP:
            self._arm()
            return
        self._resp.drop(TimeoutError(f"redis did not answer within {self._within:g} s"))

    def cancel(self) -> None:
        self._handle.cancel()


class RedisLink:
    def __init__(self, client: aioredis.Redis, prefix: str, retry_interval: float,
                 metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 timeout: float = 0.1, batches: int = 4, opened: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self._retry_interval = retry_interval
        self._metrics = metrics
        self._clock = clock
        self._timeout = timeout
        self._batches = batches
        self._down_until = 0.0
        self._opened = opened  # built before its server is up: unavailable until open()
        self.up = opened
        self._queue: list[_Queued] = []
        self._flush_due = False
        self._in_flight: set[asyncio.Task[None]] = set()
        self._chores: set[asyncio.Future[Any]] = set()
        params = lean_params(client)
        self._resp = Resp(params) if params is not None else None  # None: TLS, redis-py
        metrics.redis_up.set(1 if opened else 0)

    def open(self) -> None:
        """The server is up: calls go through from now on."""
        self._opened = self.up = True
        self._metrics.redis_up.set(1)

    async def warm(self, within: float = 5.0) -> None:
        """Open the batches' connections before the first request needs them: a connection
        made on a busy machine can take longer than ``timeout``, and a first request that
        waited for it would send every session to consistent hashing for a while."""
        try:
            await bounded(asyncio.gather(*(self.client.ping() for _ in range(self._batches))),
                          within)
        except FAILURES as exc:
            log.warning("redis not answering at start (%s); serving without it meanwhile",
                        type(exc).__name__)

    @property
    def available(self) -> bool:
        return self._opened and (self.up or self._clock() >= self._down_until)

    async def execute(self, *commands: Command,
                      patient: bool = False) -> tuple[bool, list[Any]]:
        """Run ``commands`` (argument tuples such as ``("GET", key)``, optionally ending in
        a dict of redis-py parser options such as ``{"get": True}``) in the next shared
        pipeline: (True, their results), or (False, []) when Redis can't answer. A result
        may be an exception instance when only that command failed. ``patient``: sent even
        while the link counts as down after a failure (a caller off the hot path, such as
        the batch store, that would rather ask than answer 503 until ``retry_interval``
        has passed: one late answer on a busy host would fail every such call for that
        long); its answer brings the link back up."""
        if not (self.available or (patient and self._opened)):
            return False, []
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((commands, future))
        if not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._flush)  # once every caller of this turn has queued
        try:
            return True, await future
        except FAILURES:
            return False, []

    def _flush(self) -> None:
        self._flush_due = False
        if not self._queue or len(self._in_flight) >= self._batches:
            return  # a batch that finishes flushes the rest
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._send(batch), name="redis-batch")
        self._in_flight.add(task)
        task.add_done_callback(partial(self._sent, batch))

    def _sent(self, batch: list[_Queued], task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        for _, future in batch:  # cancelled before it ran (the link closing): none answered
            if not future.done():
                future.set_exception(ConnectionError("cancelled"))
        if self._queue and not self._flush_due:
            self._flush()

    async def _send(self, batch: list[_Queued]) -> None:
        started = self._clock()
        try:
            if self._resp is not None:
                results = await self._lean(batch, self._resp)
            else:
                pipe = self.client.pipeline(transaction=False)
                for commands, _ in batch:
                    for args in commands:
                        if isinstance(args[-1], dict):  # options for redis-py's parser
                            pipe.execute_command(*args[:-1], **args[-1])
                        else:
                            pipe.execute_command(*args)
                results = await bounded(pipe.execute(raise_on_error=False), self._timeout)
        except (Exception, asyncio.CancelledError) as exc:
            error: Exception = ConnectionError("cancelled")
            if isinstance(exc, FAILURES):
                self._failed(exc)
                error = exc
            elif isinstance(exc, Exception):  # a bug of ours: the callers still get answers
                log.exception("redis batch failed")
                self._failed(exc)
                error = ConnectionError(f"redis batch failed: {type(exc).__name__}")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        self._answered(started)
        at = 0
        for commands, future in batch:
            if not future.done():  # its caller may have been cancelled meanwhile
                future.set_result(results[at:at + len(commands)])
            at += len(commands)

    async def _lean(self, batch: list[_Queued], resp: Resp) -> list[Any]:
        """The batch on the link's own RESP connection, within ``timeout`` (forgiving the
        loop's lag as ``bounded`` does, with one timer instead of a task and a wait)."""
        if not resp.connected:
            await bounded(resp.connect(), self._timeout)
        future = resp.send([args[:-1] if isinstance(args[-1], dict) else args
                            for commands, _ in batch for args in commands])
        watch = _Watch(future, resp, self._timeout)
        try:
            return await future
        finally:
            watch.cancel()

    def soon(self, *commands: Command,
             then: Callable[[bool, list[Any]], None] | None = None) -> None:
        """``execute`` off the caller's path: a write nobody waits for (kept until it is
        done, and awaited when the link closes); ``then`` gets its answer."""
        task = asyncio.get_running_loop().create_task(self._chore(commands, then))
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _chore(self, commands: tuple[Command, ...],
                     then: Callable[[bool, list[Any]], None] | None) -> None:
        answered, results = await self.execute(*commands)
        if then is not None:
            then(answered, results)

    async def settled(self) -> None:
        """Until the writes made with ``soon`` are done (and those their answers made)."""
        while self._chores:
            await asyncio.gather(*self._chores, return_exceptions=True)

    async def call(self, op: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """Run ``op`` against Redis: (True, result), or (False, None) when Redis can't answer."""
        if not self.available:
            return False, None
        started = self._clock()
        try:
            result = await bounded(op(), self._timeout)
        except FAILURES as exc:
            self._failed(exc)
            return False, None
        self._answered(started)
        return True, result

    def _failed(self, exc: BaseException) -> None:
        self._metrics.redis_errors.inc()
        self._down_until = self._clock() + self._retry_interval
        if self.up:
            # Every pooled connection may be dead (a restarted server): drop them all, so
            # the next try opens fresh ones instead of failing once per stale connection.
            if self._resp is not None:
                self._resp.drop(ConnectionError("redis failed"))
            task = asyncio.ensure_future(self.client.connection_pool.disconnect())
            self._chores.add(task)
            task.add_done_callback(self._chores.discard)
            self.up = False
            self._metrics.redis_up.set(0)
            log.warning("redis unavailable (%s: %s): pins fall back to consistent hashing, "
                        "breakers to local state, until it answers again",
                        type(exc).__name__, exc)

    def _answered(self, started: float) -> None:
        self._metrics.redis_latency.observe(self._clock() - started)
        if not self.up:
            self.up = True
            self._metrics.redis_up.set(1)
            log.warning("redis answers again: shared state restored")

    async def aclose(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, *self._chores, return_exceptions=True)
        if self._resp is not None:
            await self._resp.aclose()
        await self.client.aclose()

    def __repr__(self) -> str:
        return (f"<RedisLink [{'up' if self.up else 'down'} | {len(self._queue)} queued, "
                f"{len(self._in_flight)} batches in flight]>")
