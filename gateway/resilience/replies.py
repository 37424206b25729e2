"""The reply cache behind degraded answers: earlier successful replies, kept in Redis.

A reply is kept under a hash of the normalized request: the route and every body field
except those that cannot change the answer (``stream``, ``user``...), with sorted keys, so
the same question asked streaming or not, by anyone, finds the same answer. Only requests
the config allows are kept (at or below ``cache_max_temperature``, one choice), each for
``cache_ttl`` and at most ``cache_max_bytes``. The request path only hands over the chunks
it relayed anyway, into a bounded queue; folding, hashing and writing happen afterwards in
one writer task.
A small in-process copy answers while Redis is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import orjson
from prometheus_client import Counter

from gateway.config import DegradedSection
from gateway.resilience.sse import fold
from gateway.state.link import RedisLink
from gateway.types import Request

log = logging.getLogger("gateway.replies")

CACHEABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# Fields that change how or to whom an answer is delivered, not what it says.
WRITE_BATCH = 64  # replies per Redis pipeline from the writer
NOT_PART_OF_THE_QUESTION = frozenset({"stream", "stream_options", "user", "metadata", "store",
                                      "service_tier", "request_id", "priority"})


def cache_key(request: Request) -> str:
    question = {k: v for k, v in request.payload.items() if k not in NOT_PART_OF_THE_QUESTION}
    digest = hashlib.sha256(request.path.encode() + b"\0" + orjson.dumps(
        question, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return digest


class ReplyCache:
    def __init__(self, settings: DegradedSection, link: RedisLink | None = None,
                 dropped: Counter | None = None, queue_size: int = 1024) -> None:
        self._settings = settings
        self.link = link
        # key -> (monotonic expiry, body): the copy lives no longer than the Redis entry.
        self._local: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        # Writes wait here for the one writer, so a burst of finished replies can never
        # take the connections or the round trips that pin lookups need; past the bound
        # a reply is simply not kept (counted).
        self._queue: asyncio.Queue[tuple[Request, Sequence[bytes], bool]] = (
            asyncio.Queue(queue_size))
        self._dropped = dropped
        self._writer: asyncio.Task[None] | None = None

    def wants(self, request: Request) -> bool:
        """Cheap, on the request path: may this request's reply be kept?"""
        if not self._settings.cache or request.path not in CACHEABLE_PATHS:
            return False
        if request.path == "/v1/embeddings":
            return True
        payload = request.payload
        temperature = payload.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if not isinstance(temperature, int | float):
            return False
        return temperature <= self._settings.cache_max_temperature and payload.get(
            "n", 1) in (1, None)

    def keep(self, request: Request, parts: Sequence[bytes], stream: bool) -> None:
        """Hand over a finished successful reply; the work happens in the writer task."""
        try:
            self._queue.put_nowait((request, parts, stream))
        except asyncio.QueueFull:
            if self._dropped is not None:
                self._dropped.inc()
            return
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="reply-cache")

    async def _write(self) -> None:
        """Take what is queued (up to ``WRITE_BATCH`` replies), write it in one pipeline."""
        while True:
            batch = [await self._queue.get()]
            while len(batch) < WRITE_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._keep(batch)
            except Exception:  # one bad reply must not stop the writer
                log.exception("replies not kept")
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _keep(self, batch: list[tuple[Request, Sequence[bytes], bool]]) -> None:
        fresh: dict[str, bytes] = {}
        for request, parts, stream in batch:
            key = cache_key(request)
            if key in fresh or self._is_fresh(key):
                continue  # the same question, answered moments ago: kept already
            data = b"".join(parts)
            body = fold(request.path, data) if stream else data
            if body is None or len(body) > self._settings.cache_max_bytes:
                continue
            self._remember(key, body)
            fresh[key] = body
        if self.link is None or not fresh:
            return
        ttl_ms = int(self._settings.cache_ttl * 1000)
        prefix = self.link.prefix + "reply:"
        await self.link.execute(*(("SET", prefix + key, body, "PX", ttl_ms)
                                  for key, body in fresh.items()))

    def _is_fresh(self, key: str) -> bool:
        """Was an answer to this question kept less than a tenth of its lifetime ago? (At
        the temperatures the cache takes, a new answer would say the same; only its id and
        timestamp differ, so it is neither folded nor written.)"""
        local = self._local.get(key)
        if local is None:
            return False
        return local[0] - time.monotonic() > self._settings.cache_ttl * 0.9

    def _remember(self, key: str, body: bytes) -> None:
        if self._settings.local_entries <= 0:
            return
        self._local[key] = (time.monotonic() + self._settings.cache_ttl, body)
        self._local.move_to_end(key)
        while len(self._local) > self._settings.local_entries:
            self._local.popitem(last=False)

    async def lookup(self, request: Request) -> bytes | None:
        if not self.wants(request):
            return None
        key = cache_key(request)
        if self.link is not None:
            answered, results = await self.link.execute(("GET", self.link.prefix + "reply:" + key))
            value = results[0] if answered else None
            if value and not isinstance(value, Exception):
                return value.encode() if isinstance(value, str) else bytes(value)
        local = self._local.get(key)
        if local is None:
            return None
        if local[0] <= time.monotonic():
            del self._local[key]
            return None
        return local[1]

    async def aclose(self) -> None:
        """Let queued replies be written (briefly) before the Redis link goes."""
        if self._writer is None:
            return
        if not self._queue.empty():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), 1.0)
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)
        self._writer = None

    def __repr__(self) -> str:
        return f"<ReplyCache [{len(self._local)} local | {self._queue.qsize()} queued]>"
