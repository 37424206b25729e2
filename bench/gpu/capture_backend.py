"""A stand-in for vLLM's front end with ``--api-server-count N``, that records what reaches it.

vLLM 0.26 binds one listening socket and hands it to N API-server processes (uvicorn on
uvloop); whichever process accepts a connection serves every request on it. This does the
same (``--procs``), answers chat completions with a stream of ``--chunks`` SSE events
(``--ttft`` / ``--gap`` seconds, optional ``--cpu-ms`` of busy work per request and
``--chunk-cpu-ms`` per event in the accepting process, as vLLM's tokenizer and
detokenizer spend), and writes one JSON line per request to ``--log``: the accepting pid,
the connection (peer port) and whether it is the connection's first request, the arrival
time, the request line, headers and the exact body bytes.

    python -m bench.gpu.capture_backend --port 8001 --procs 4 --log /tmp/cap.jsonl

``python -m bench.gpu.capture_backend --summary /tmp/cap.jsonl --gap-s 1`` splits the log
into bursts (arrivals more than ``--gap-s`` apart) and prints, per burst, the requests
per process, the new connections, and the arrival spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import time
from collections import Counter
from typing import Any


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def make_app(args: argparse.Namespace, log: Any) -> Any:
    seen: set[tuple[str, int]] = set()
    pid = os.getpid()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        arrived = time.time()
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        peer = tuple(scope.get("client") or ("", 0))
        first = peer not in seen
        seen.add(peer)  # type: ignore[arg-type]
        path = scope["path"]
        if scope["method"] == "GET":
            data = (b'{"object":"list","data":[{"id":"test","object":"model"}]}'
                    if path == "/v1/models" else b"")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        log.write(json.dumps({
            "pid": pid, "peer": peer[1], "first": first, "t": arrived, "path": path,
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "body": body.decode("utf-8", "replace")}) + "\n")
        log.flush()
        busy(args.cpu_ms)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(args.ttft)
        event = (b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,'
                 b'"model":"test","choices":[{"index":0,"delta":{"content":"ab"},'
                 b'"logprobs":null,"finish_reason":null}]}\n\n')
        for i in range(args.chunks):
            if i:
                await asyncio.sleep(args.gap)
            busy(args.chunk_cpu_ms)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as vLLM: one socket anyway
    sock.bind(("127.0.0.1", args.port))
    sock.set_inheritable(True)
    kids = []
    for _ in range(args.procs):
        pid = os.fork()
        if pid == 0:
            log = open(args.log, "a", buffering=1)
            config = uvicorn.Config(make_app(args, log), loop="uvloop", http="httptools",
                                    log_level="warning", access_log=False, backlog=2048,
                                    proxy_headers=False)
            uvicorn.Server(config).run(sockets=[sock])
            os._exit(0)
        kids.append(pid)
    print(f"capture backend on {args.port}: pids {kids}", flush=True)
    for pid in kids:
        os.waitpid(pid, 0)


def summary(path: str, gap_s: float) -> None:
    rows = sorted((json.loads(line) for line in open(path)), key=lambda r: r["t"])
    bursts: list[list[dict[str, Any]]] = []
    for r in rows:
        if not bursts or r["t"] - bursts[-1][-1]["t"] > gap_s:
            bursts.append([])
        bursts[-1].append(r)
    pids = sorted({r["pid"] for r in rows})
    for n, b in enumerate(bursts):
        per = Counter(r["pid"] for r in b)
        shares = [per.get(p, 0) for p in pids]
        ts = sorted(r["t"] for r in b)
        print(json.dumps({
            "burst": n, "requests": len(b), "per_process": shares,
            "max_share": round(max(shares) / len(b), 3),
            "new_connections": sum(r["first"] for r in b),
            "connections": len({r["peer"] for r in b}),
            "arrival_spread_ms": round((ts[-1] - ts[0]) * 1000, 2),
            "arrival_p50_ms": round((statistics.median(ts) - ts[0]) * 1000, 2),
        }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--log", default="capture.jsonl")
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--gap", type=float, default=0.01)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--cpu-ms", type=float, default=0.0)
    parser.add_argument("--chunk-cpu-ms", type=float, default=0.0)
    parser.add_argument("--summary", metavar="JSONL")
    parser.add_argument("--gap-s", type=float, default=0.5)
    args = parser.parse_args()
    if args.summary:
        summary(args.summary, args.gap_s)
    else:
        serve(args)


if __name__ == "__main__":
    main()
