"""Flow control under a noisy neighbour (issue 21): one simulator with a capacity model
(``--capacity C`` requests generate at once, the rest wait in its own FIFO queue, as in
vLLM's scheduler), tenant A flooding at 10x its capacity, tenant B sending at 10 % of it.
B's TTFT (streamed, to its first token) is compared across:

- unloaded: B alone;
- no flow control: the gateway in its default configuration, the backend's capacity not
  declared (today's behaviour: every request goes straight into vLLM's queue);
- flow control: ``max_concurrent = C`` on the backend, so the rest waits in the gateway's
  queue, round robin across tenants;
- flow control, two replicas sharing one Redis, each declaring C/2, the load alternating.

Every run counts A's answers by status (a 503 is shed with Retry-After) and requests that
got no answer within the client's limit (hung). The gateways run the shipped config.toml
with two [[keys]] added (so each tenant is known by name).

    .venv/bin/python -m bench.flow [--seconds 10] [--capacity 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common import LOAD_CORE, PROXY_CORE, free_port, start, stop, wait_http
from bench.targets import SHIPPED, to_toml

KEYS = {"A": "tenant-a-bench-key", "B": "tenant-b-bench-key"}
CLIENT_LIMIT = 30.0  # seconds a client waits for its reply before calling it hung


@dataclass
class Result:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"A": [], "B": []})
    status: dict[str, dict[str, int]] = field(default_factory=lambda: {"A": {}, "B": {}})

    def count(self, tenant: str, status: str) -> None:
        self.status[tenant][status] = self.status[tenant].get(status, 0) + 1


async def one(http: aiohttp.ClientSession, url: str, tenant: str, tokens: int,
              result: Result) -> None:
    body = {"model": "sim-model", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"hello from {tenant}"}]}
    began = time.perf_counter()
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {KEYS[tenant]}"}) as reply:
            if reply.status != 200:
                await reply.read()
                result.count(tenant, str(reply.status))
                return
            first = True
            async for _ in reply.content.iter_any():
                if first:
                    result.ttft[tenant].append(time.perf_counter() - began)
                    first = False
            result.count(tenant, "200")
    except (TimeoutError, aiohttp.ClientError):
        result.count(tenant, "hung" if time.perf_counter() - began >= CLIENT_LIMIT else "error")


async def load(urls: list[str], rates: dict[str, float], seconds: float,
               tokens: int) -> Result:
    """Open-loop arrivals at fixed rates per tenant; the URLs taken in turn."""
    result = Result()
    rng = random.Random(18)
    timeout = aiohttp.ClientTimeout(total=CLIENT_LIMIT)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        tasks = []
        began = time.perf_counter()
        schedule = sorted((n / rate, tenant) for tenant, rate in rates.items() if rate
                          for n in range(int(rate * seconds)))
        for i, (at, tenant) in enumerate(schedule):
            delay = began + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # A's replies vary in length (a quarter to 1.75 times ``tokens``), as real
            # replies do: places then free one by one instead of in lockstep.
            length = tokens if tenant == "B" else rng.randint(max(1, tokens // 4),
                                                              tokens * 7 // 4)
            tasks.append(asyncio.create_task(one(http, urls[i % len(urls)], tenant, length,
                                                 result)))
        await asyncio.gather(*tasks)
    return result


def config(sim: str, port: int, capacity: int, redis: str | None) -> str:
    raw = tomllib.loads(SHIPPED.read_text())
    raw["gateway"] = {**raw.get("gateway", {}), "listen": f"127.0.0.1:{port}", "workers": 1}
    backend: dict[str, object] = {"name": "sim", "url": sim}
    if capacity:
        backend["max_concurrent"] = capacity
    raw["backends"] = [backend]
    raw["keys"] = [{"name": t, "key": k} for t, k in KEYS.items()]
    raw["queue"] = {"max_length": 64, "max_wait": 10.0}
    if redis is not None:
        raw["redis"] = {**raw.get("redis", {}), "url": redis}
    return to_toml(raw)


def gateways(sim: str, tmp: Path, n: int, capacity: int,
             redis: str | None) -> list[tuple[str, subprocess.Popen[bytes]]]:
    out = []
    for i in range(n):
        port = free_port()
        home = Path(tempfile.mkdtemp(prefix=f"gw{i}-", dir=tmp))
        (home / "gateway.toml").write_text(config(sim, port, capacity, redis))
        proc = start(PROXY_CORE, [sys.executable, "-m", "gateway", "serve", "--config",
                                  str(home / "gateway.toml")], home / "gateway.log", cwd=home)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz")
        out.append((url, proc))
    return out


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = start(LOAD_CORE, [sys.executable, "-m", "gateway", "sim", "--port", str(sim_port),
                            "--capacity", str(args.capacity), "--ttft", str(args.ttft),
                            "--itl", str(args.itl)], tmp / "sim.log")
    from gateway.state.embedded import valkey_binary

    redis_port = free_port()
    redis = subprocess.Popen([str(valkey_binary()), "--port", str(redis_port), "--save", "",
                              "--appendonly", "no", "--dir", str(tmp)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    service = args.ttft + args.itl * (args.tokens - 1)
    capacity_rps = args.capacity / service
    rates = {"A": 10 * capacity_rps, "B": 0.1 * capacity_rps}
    out: dict[str, object] = {"capacity": args.capacity, "service_s": service,
                              "rates_rps": rates, "seconds": args.seconds}
    try:
        wait_http(sim_url + "/health")
        runs = [("unloaded", 1, 0, {"B": rates["B"]}),
                ("no flow control", 1, 0, rates),
                ("flow control", 1, args.capacity, rates),
                ("flow control, 2 replicas", 2, args.capacity // 2, rates)]
        for name, n, capacity, load_rates in runs:
            shared = f"redis://127.0.0.1:{redis_port}/0" if n > 1 else None
            started = gateways(sim_url, tmp, n, capacity, shared)
            try:
                result = asyncio.run(load([u for u, _ in started], load_rates, args.seconds,
                                          args.tokens))
            finally:
                for _, proc in started:
                    stop(proc)
            wait_http(sim_url + "/health")
            settle(sim_url)
            out[name] = {"B_ttft_p50_s": statistics.median(result.ttft["B"] or [float("nan")]),
                         "B_ttft_p99_s": p99(result.ttft["B"]),
                         "A_ttft_p50_s": statistics.median(result.ttft["A"] or [float("nan")]),
                         "status": result.status}
            print(name, json.dumps(out[name]), flush=True)
    finally:
        stop(sim)
        redis.kill()
    return out


def settle(sim: str, within: float = 120.0) -> None:
    """Wait until the simulator has nothing left running from the run before."""
    import httpx

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if httpx.get(sim + "/sim/stats", timeout=5).json()["running"] == 0:
            return
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--ttft", type=float, default=0.2)
    parser.add_argument("--itl", type=float, default=0.02)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--raw", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flow-") as tmp:
        out = run(args, Path(tmp))
    if args.raw:
        args.raw.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
