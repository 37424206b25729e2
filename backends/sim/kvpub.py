"""The simulator's KV events on ZMQ, sent and replayed as vLLM 0.32's ``ZmqEventPublisher``
does (``vllm/distributed/kv_events.py:474-527``): a PUB socket sends ``[topic, seq,
payload]`` (``seq`` 8 bytes big-endian from 0, the payload a msgpack array ``[ts, events,
0]`` of event maps), and a ROUTER answers ``[id, b"", start]`` with each kept batch from
``start`` on, ``[id, b"", topic, seq, payload]``, then ``[id, b"", b"", END, b""]``.
``drop``: every ``drop``-th batch is kept for replays but never sent (a lost message)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.asgi import Receive, Send

END = b"\xff" * 8
KEEP = 10_000  # vLLM's buffer_steps


class KvPublisher:
    def __init__(self, endpoint: str, replay: str = "", drop: int = 0,
                 topic: bytes = b"kv") -> None:
        self._endpoint, self._replay, self._drop, self._topic = endpoint, replay, drop, topic
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=KEEP)
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._serving: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind (inside the running loop: the replay is served by a task of its own)."""
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self._endpoint)
        if self._replay:
            self._router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(self._replay)
            self._serving = asyncio.get_running_loop().create_task(self._serve())

    def publish(self, events: list[dict[str, Any]]) -> None:
        seq, self._seq = self._seq, self._seq + 1
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self._kept.append((seq, payload))
        if self._pub is None or (self._drop and (seq + 1) % self._drop == 0):
            return
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload],
                                 flags=zmq.NOBLOCK)

    async def _serve(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, first = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._kept):
                if seq >= first:
                    await self._router.send_multipart(
                        [ident, b"", self._topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([ident, b"", b"", END, b""])

    async def stop(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()


async def lifespan(receive: Receive, send: Send, kv: KvPublisher | None) -> None:
    """The simulator's ASGI lifespan: its KV publisher bound at start, closed at the end."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if kv is not None:
                kv.start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if kv is not None:
                await kv.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
