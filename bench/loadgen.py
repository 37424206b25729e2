"""An asyncio load generator for OpenAI-style streaming endpoints.

Runs ``concurrency`` workers, each sending ``requests`` chat completions in a row, and
reports time to first token (first content event) and whole-stream latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import aiohttp


@dataclass
class Result:
    requests: int
    errors: int
    wall_s: float
    ttft_ms: dict[str, float]
    total_ms: dict[str, float]

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "mean": round(statistics.fmean(ordered) * 1000, 3)}


async def _one(session: aiohttp.ClientSession, url: str, body: bytes,
               ttfts: list[float], totals: list[float]) -> bool:
    start = time.perf_counter()
    first = None
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return False
        tail = b""
        async for chunk in r.content.iter_any():
            if first is None and b'"content":"' in chunk:
                first = time.perf_counter()
            tail = (tail + chunk)[-32:]
        if b"[DONE]" not in tail:
            return False
    end = time.perf_counter()
    ttfts.append((first or end) - start)
    totals.append(end - start)
    return True


async def run(base_urls: list[str], concurrency: int, requests: int, tokens: int,
              model: str = "sim-model", warmup: int = 1) -> Result:
    """Worker i talks to ``base_urls[i % len(base_urls)]``."""
    urls = [u.rstrip("/") + "/v1/chat/completions" for u in base_urls]
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "benchmark"}]}).encode()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600)
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def worker(i: int, n: int) -> int:
            url = urls[i % len(urls)]
            bad = 0
            for _ in range(n):
                try:
                    ok = await _one(session, url, body, ttfts, totals)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                bad += not ok
            return bad

        await asyncio.gather(*(worker(i, warmup) for i in range(concurrency)))
        ttfts.clear()
        totals.clear()
        started = time.perf_counter()
        errors = sum(await asyncio.gather(*(worker(i, requests) for i in range(concurrency))))
        wall = time.perf_counter() - started
    return Result(concurrency * requests, errors, wall, percentiles(ttfts), percentiles(totals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url", nargs="+")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4, help="per worker")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(run(args.url, args.concurrency, args.requests, args.tokens))
    print(json.dumps({**asdict(result), "rps": round(result.rps, 1)}))


if __name__ == "__main__":
    main()
