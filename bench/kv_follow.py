"""Issue 38 point 2: where the KV index should live. Each serving process follows every
instance's events itself today (ZMQ's PUB fans out to each subscriber); the alternative is
one index in the control process that the workers ask (or that publishes to them). This
measures what each costs per request of a workload:

- following: decoding and applying one engine step's batch as vLLM 0.32 sends it (a
  ``BlockStored`` of a prompt's blocks, and later its ``BlockRemoved``), per batch, in one
  process: every worker pays it for every batch of every instance;
- asking: one request's lookup sent to another process over a unix socket (aiohttp, as the
  control link talks): the worker's and the answering process's CPU, and the round trip
  added to the request's path.

    python -m bench.kv_follow --blocks 125 --batches 2000 --asks 2000

125 blocks is a 2,000-token prompt at vLLM's GPU block size (16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from gateway.kv.events import decode
from gateway.kv.index import Index, keys


def batches(blocks: int, n: int) -> list[bytes]:
    """``n`` batches alternating a prompt's stored blocks and, later, their removal."""
    out = []
    for i in range(n // 2):
        tokens = [(i * 7919 + t) % 32000 for t in range(blocks * 16)]
        hashes = [(i << 20) + b for b in range(blocks)]
        out.append(msgspec.msgpack.encode([time.time(), [{
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": None}], 0]))
        out.append(msgspec.msgpack.encode([time.time(), [{
            "type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}], 0]))
    return out


def follow(blocks: int, n: int) -> dict[str, float]:
    payloads, index = batches(blocks, n), Index()
    start = time.process_time()
    for payload in payloads:
        index.apply("a", decode(payload))
    cpu = time.process_time() - start
    return {"follow_us_per_batch": round(cpu / n * 1e6, 1)}


SERVER = """
import asyncio, sys
from aiohttp import web
async def ask(request):
    body = await request.read()
    return web.Response(body=b'{"a":1984,"b":0}', content_type="application/json")
app = web.Application()
app.router.add_post("/kv/ask", ask)
web.run_app(app, path=sys.argv[1], print=None)
"""


def cpu_of(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ask(path: str, blocks: int, n: int, pid: int) -> dict[str, float]:
    import aiohttp

    body = json.dumps({"model": "m", "keys": [k.hex() for k in keys(list(range(blocks * 16 + 1)),
                                                                      16)]}).encode()
    connector = aiohttp.UnixConnector(path=path)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):  # warm
            async with session.post("http://control/kv/ask", data=body) as reply:
                await reply.read()
        walls, mine, theirs = [], time.process_time(), cpu_of(pid)
        for _ in range(n):
            start = time.perf_counter()
            async with session.post("http://control/kv/ask", data=body) as reply:
                await reply.read()
            walls.append(time.perf_counter() - start)
        mine, theirs = time.process_time() - mine, cpu_of(pid) - theirs
    return {"ask_rtt_p50_us": round(statistics.median(walls) * 1e6, 1),
            "ask_worker_us": round(mine / n * 1e6, 1),
            "ask_control_us": round(theirs / n * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=125)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--asks", type=int, default=2000)
    args = parser.parse_args()
    result: dict[str, Any] = {"blocks": args.blocks, **follow(args.blocks, args.batches)}
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "control.sock")
        server = subprocess.Popen([sys.executable, "-c", SERVER, path])
        try:
            deadline = time.monotonic() + 10
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            result.update(asyncio.run(ask(path, args.blocks, args.asks, server.pid)))
        finally:
            server.terminate()
            server.wait()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
