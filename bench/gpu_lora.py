"""Issue 41 point 5 on a GPU host: many LoRA adapters of one base on a few instances, through
one gateway that spawns the instances and loads the adapters (``bench/gpu/lora.sh`` writes
its config and starts it, one gateway run per arm).

    python -m bench.gpu_lora --gateway http://127.0.0.1:9400 --adapters a01,a02,... \
        --arm aware --seconds 180 --rate 8 --zipf 1.1 --out lora.jsonl --requests req.jsonl
    python -m bench.gpu_lora --summary lora.jsonl

The client: streamed chat completions of ``--max-tokens`` tokens (``ignore_eos``), each
naming one of ``--adapters`` by Zipf popularity (the first the most asked), Poisson
arrivals at ``--rate`` per second. Per arm, from the client: requests, errors (goal: 0),
TTFT p50/p90/p99, output tokens per second, requests per instance (the gateway's
``x-gateway-backend``) and how many instances each adapter was sent to; from the gateway's
``/metrics`` before and after: adapter loads (``gateway_adapter_loads_total``) and loads
per minute, and the mean load time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import urllib.request
from collections import Counter, defaultdict
from typing import Any

import aiohttp

from bench.gpu_sleep import _append, one, pct, zipf_weights

SERIES = re.compile(r'^(gateway_adapter_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$')


def scrape(base: str) -> dict[tuple[str, str], float]:
    """The gateway's adapter series: (name, labels) -> value."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {(m[1], m[2]): float(m[3]) for line in text.splitlines()
            if (m := SERIES.match(line))}


def summed(delta: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in delta.items() if n == name
               and all(f'{k}="{x}"' in lab for k, x in labels.items()))


async def arm(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(41)
    adapters = args.adapters.split(",")
    weights = zipf_weights(len(adapters), args.zipf)
    before = await asyncio.to_thread(scrape, args.gateway)
    t0, at, n, tasks = time.perf_counter(), 0.0, 0, []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while at < args.seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            model = rng.choices(adapters, weights)[0]
            tasks.append(asyncio.create_task(one(session, args.gateway, model, n,
                                                 args.max_tokens)))
            n += 1
            at += rng.expovariate(args.rate)
        rows = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # the workers' counts settle
    after = await asyncio.to_thread(scrape, args.gateway)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if args.requests:
        await asyncio.to_thread(_append, args.requests, "".join(
            json.dumps({"arm": args.arm, **r}) + "\n" for r in rows))
    ok = [r for r in rows if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    spread: dict[str, set[str]] = defaultdict(set)
    for r in ok:
        spread[r["model"]].add(r.get("backend") or "?")
    loads = summed(delta, "gateway_adapter_loads_total", result="loaded")
    took = summed(delta, "gateway_adapter_load_seconds_sum")
    return {
        "arm": args.arm, "requests": len(rows), "errors": len(rows) - len(ok),
        "error_samples": [r.get("error") or r["status"] for r in rows if not r["ok"]][:5],
        "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p90_ms": pct(ttfts, 0.9),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "output_tokens_per_s": round(len(ok) * args.max_tokens / wall, 1),
        "per_instance": dict(sorted(Counter(r.get("backend") for r in ok).items())),
        "instances_per_adapter": round(sum(map(len, spread.values())) / max(1, len(spread)), 2),
        "per_adapter": dict(Counter(r["model"] for r in rows).most_common()),
        "adapter_loads": loads, "loads_per_min": round(60 * loads / wall, 1),
        "load_s_mean": round(took / loads, 3) if loads else None,
        "load_failures": summed(delta, "gateway_adapter_loads_total", result="failed")
        + summed(delta, "gateway_adapter_loads_total", result="refused"),
    }


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| arm | requests | errors | TTFT p50 / p90 / p99 ms | output tok/s | adapter loads "
          "(per min) | mean load s | instances per adapter | requests per instance |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['requests']} | {r['errors']} | {r['ttft_p50_ms']} / "
              f"{r['ttft_p90_ms']} / {r['ttft_p99_ms']} | {r['output_tokens_per_s']} | "
              f"{r['adapter_loads']:g} ({r['loads_per_min']}) | {r['load_s_mean']} | "
              f"{r['instances_per_adapter']} | "
              f"{' '.join(str(v) for v in r['per_instance'].values())} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", default="http://127.0.0.1:9400")
    ap.add_argument("--adapters", required=False, default="a01,a02")
    ap.add_argument("--arm", default="arm")
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--out", default="lora.jsonl")
    ap.add_argument("--requests", help="one line per request")
    ap.add_argument("--summary", help="print the table of a --out file")
    args = ap.parse_args()
    if args.summary:
        summary(args.summary)
        return
    result = asyncio.run(arm(args))
    with open(args.out, "a") as out:
        out.write(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
