"""An asyncio load generator for OpenAI-style endpoints.

``concurrency`` workers each send ``requests`` chat completions in a row (worker i to
``urls[i % len(urls)]``) and record time to first event, gaps between chunks, whole
latency, and the events and bytes of every stream, so that runs through different
proxies can be checked against the direct one.

By default every worker starts at once, so each round of requests arrives as one burst.
``--spread S`` starts worker i at ``i * S / concurrency`` instead: with S one stream's
length, arrivals are evenly spaced and ``concurrency`` streams stay open at any moment
(the steady state of a service holding that many streams).

    python -m bench.loadgen http://127.0.0.1:8080 --concurrency 64 --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)  # (events, bytes)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class Result:
    requests: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    rps: float
    ttft_ms: dict[str, float]
    total_ms: dict[str, float]
    gap_ms: dict[str, float]
    shapes: dict[str, int]  # "events/bytes" -> streams
    cpu_s: float  # this load generator's own CPU during the measured part


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"),
                "mean": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "mean": round(statistics.fmean(ordered) * 1000, 3)}


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes, s: Samples) -> None:
    start = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            s.errors[f"http {r.status}"] += 1
            return
        first = last = None
        events = size = 0
        tail = b""
        gaps = []
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)  # type: ignore[operator]
            last = now
            events += chunk.count(b"data: ")
            size += len(chunk)
            tail = (tail + chunk)[-32:]
    end = time.perf_counter()
    if b"[DONE]" not in tail:
        s.errors["truncated"] += 1
        return
    s.ttft.append((first or end) - start)
    s.total.append(end - start)
    s.gaps.extend(gaps)
    s.shapes[(events, size)] += 1


async def _plain(session: aiohttp.ClientSession, url: str, body: bytes, s: Samples) -> None:
    start = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        data = await r.read()
        if r.status != 200:
            s.errors[f"http {r.status}"] += 1
            return
    end = time.perf_counter()
    s.ttft.append(end - start)
    s.total.append(end - start)
    s.shapes[(1, len(data))] += 1


async def run(urls: list[str], concurrency: int, requests: int, tokens: int,
              model: str = "sim-model", stream: bool = True, warmup: int = 1,
              timeout_s: float = 300, spread: float = 0) -> Result:
    targets = [u.rstrip("/") + "/v1/chat/completions" for u in urls]
    body = json.dumps({"model": model, "stream": stream, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "benchmark"}]}).encode()
    one = _stream if stream else _plain
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def worker(i: int, n: int, s: Samples, delay: float = 0) -> None:
            url = targets[i % len(targets)]
            if delay:
                await asyncio.sleep(delay)
            for _ in range(n):
                try:
                    await one(session, url, body, s)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    s.errors[type(exc).__name__] += 1

        if warmup:
            await asyncio.gather(*(worker(i, warmup, Samples()) for i in range(concurrency)))
        s = Samples()
        cpu = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(worker(i, requests, s, i * spread / concurrency)
                               for i in range(concurrency)))
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
    n = concurrency * requests
    return Result(
        requests=n, errors=sum(s.errors.values()), error_kinds=dict(s.errors), wall_s=wall,
        rps=round(n / wall, 1), ttft_ms=percentiles(s.ttft), total_ms=percentiles(s.total),
        gap_ms=percentiles(s.gaps), shapes={f"{e}/{b}": c for (e, b), c in s.shapes.items()},
        cpu_s=round(cpu, 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="+")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4, help="per worker")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="requests per worker first")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request")
    parser.add_argument("--spread", type=float, default=0,
                        help="seconds over which the workers' first requests are spread")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(run(args.url, args.concurrency, args.requests, args.tokens,
                             args.model, not args.no_stream, args.warmup, args.timeout,
                             args.spread))
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
