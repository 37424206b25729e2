"""An asyncio load generator for OpenAI-style endpoints.

``concurrency`` workers each send ``requests`` chat completions in a row (worker i to
``urls[i % len(urls)]``) and record time to first event, gaps between chunks, whole
latency, and the events and bytes of every stream, so that runs through different
proxies can be checked against the direct one.

By default every worker starts at once, so each round of requests arrives as one burst.
``--spread S`` starts worker i at ``i * S / concurrency`` instead: with S one stream's
length, arrivals are evenly spaced and ``concurrency`` streams stay open at any moment
(the steady state of a service holding that many streams).

``--sessions`` puts an ``X-Session-ID`` on every other request (worker i's session,
``--session-pool`` N: sessions shared by every N-th worker), ``--temperature 0`` makes the
replies cacheable for the gateway's reply cache, and ``--unique-share F`` gives that share
of requests a prompt of their own (the rest repeat one prompt).

    python -m bench.loadgen http://127.0.0.1:8080 --concurrency 64 --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property

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


@dataclass(frozen=True)
class Workload:
    """What each request looks like: request j of worker i is ``request(i, j)``."""

    model: str = "sim-model"
    stream: bool = True
    tokens: int = 32
    temperature: float | None = None
    sessions: bool = False
    session_pool: int = 0  # 0: a session per worker
    unique_share: float = 0.0
    ignore_eos: bool = False  # vLLM: always max_tokens (a random-weight model may stop early)

    def _body(self, prompt: str) -> bytes:
        fields: dict[str, object] = {"model": self.model, "stream": self.stream,
                                     "max_tokens": self.tokens,
                                     "messages": [{"role": "user", "content": prompt}]}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.ignore_eos:
            fields["ignore_eos"] = True
        return json.dumps(fields).encode()

    def request(self, i: int, j: int) -> tuple[bytes, dict[str, str]]:
        headers = {"content-type": "application/json"}
        if self.sessions and (i + j) % 2 == 0:
            # Worker i's own session, or one of a pool that many workers share.
            k = (i // 2 + j) % self.session_pool if self.session_pool else i
            headers["x-session-id"] = f"bench-{k}"
        # The same draw for the same (i, j) in every run and through every target.
        unique = self.unique_share > 0 and random.Random(i * 100_003 + j).random() < (
            self.unique_share)
        return (self._body(f"benchmark {i}/{j}") if unique else self._repeated), headers

    @cached_property
    def _repeated(self) -> bytes:
        return self._body("benchmark")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"),
                "mean": float("nan"), "max": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "mean": round(statistics.fmean(ordered) * 1000, 3),
            "max": round(ordered[-1] * 1000, 3)}


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes,
                  headers: dict[str, str], s: Samples) -> None:
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as r:
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


async def _plain(session: aiohttp.ClientSession, url: str, body: bytes,
                 headers: dict[str, str], s: Samples) -> None:
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as r:
        data = await r.read()
        if r.status != 200:
            s.errors[f"http {r.status}"] += 1
            return
    end = time.perf_counter()
    s.ttft.append(end - start)
    s.total.append(end - start)
    s.shapes[(1, len(data))] += 1


def raise_fd_limit() -> None:
    """Thousands of concurrent streams need as many sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(urls: list[str], concurrency: int, requests: int, work: Workload,
              warmup: int = 1, timeout_s: float = 300, spread: float = 0,
              fresh: bool = False) -> Result:
    """``fresh``: a new connection for every request (closed after it), as a client that
    keeps none alive does; else connections are kept alive and reused."""
    targets = [u.rstrip("/") + "/v1/chat/completions" for u in urls]
    one = _stream if work.stream else _plain
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def worker(i: int, n: int, s: Samples, delay: float = 0) -> None:
            url = targets[i % len(targets)]
            if delay:
                await asyncio.sleep(delay)
            for j in range(n):
                body, headers = work.request(i, j)
                try:
                    await one(session, url, body, headers, s)
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
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--sessions", action="store_true",
                        help="an X-Session-ID on every other request")
    parser.add_argument("--session-pool", type=int, default=0,
                        help="distinct sessions (0: one per worker)")
    parser.add_argument("--unique-share", type=float, default=0.0,
                        help="share of requests with a prompt of their own")
    parser.add_argument("--fresh", action="store_true",
                        help="a new connection per request (none kept alive)")
    args = parser.parse_args()
    raise_fd_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    work = Workload(args.model, not args.no_stream, args.tokens, args.temperature,
                    args.sessions, args.session_pool, args.unique_share)
    result = asyncio.run(run(args.url, args.concurrency, args.requests, work, args.warmup,
                             args.timeout, args.spread, args.fresh))
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
