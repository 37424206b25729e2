"""Issue 39 point 6 on a GPU host: more models than fit awake, through one gateway that
spawns them (``bench/gpu/sleep.sh`` writes its config and starts it).

    python -m bench.gpu_sleep --gateway http://127.0.0.1:9000 --models a,b,c \
        --arm level1 --seconds 300 --rate 2 --zipf 1.1 --out runs.jsonl --requests req.jsonl
    python -m bench.gpu_sleep --summary runs.jsonl

The client: streamed chat completions of ``--max-tokens`` tokens, one of ``--models`` per
request by Zipf popularity (the first the most asked), the order of popularity rotating
every ``--rotate`` seconds so that each model in turn goes idle long enough to sleep (or
stop) and is then asked again; Poisson arrivals at ``--rate`` per second.

Per arm, from the client: requests, errors (goal: 0), TTFT p50/p90/p99, requests per
minute, and the TTFT of the requests that waited for a wake or a start (those whose TTFT
is above ``--waited`` seconds). From the gateway's ``/metrics`` before and after: wakes and
their mean time (``gateway_backend_state_seconds{state="waking"}`` plus ``verifying``),
cold starts and their mean time (``starting``), sleeps, and wake checks by result (every
wake checked; goal: all ``ok``). GPU memory: ``--nvml FILE`` (``nvidia-smi`` samples the
script takes) gives the least and most used during the arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

SERIES = re.compile(r'^(gateway_backend_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$')


def scrape(base: str) -> dict[tuple[str, str], float]:
    """The gateway's lifecycle series: (name, labels) -> value."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = SERIES.match(line)
        if m and ("transitions" in m[1] or "state_seconds" in m[1] or "wake_checks" in m[1]):
            out[m[1], m[2]] = float(m[3])
    return out


def summed(delta: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in delta.items() if n == name
               and all(f'{k}="{x}"' in lab for k, x in labels.items()))


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


async def one(session: aiohttp.ClientSession, base: str, model: str, n: int,
              max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {n}: tell me something."}]}
    began = time.perf_counter()
    ttft = None
    try:
        async with session.post(base + "/v1/chat/completions", json=body) as resp:
            async for chunk in resp.content.iter_any():
                if ttft is None and b'"content"' in chunk:
                    ttft = time.perf_counter() - began
            status, backend = resp.status, resp.headers.get("x-gateway-backend")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"model": model, "ok": False, "status": 0, "error": repr(exc)[:200]}
    return {"model": model, "ok": status == 200 and ttft is not None, "status": status,
            "ttft": ttft, "total": time.perf_counter() - began, "backend": backend}


def _append(path: str, text: str) -> None:
    with open(path, "a") as out:
        out.write(text)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (k + 1) ** s for k in range(n)]


async def arm(args: argparse.Namespace, name: str) -> dict[str, Any]:
    rng = random.Random(39)
    models = args.models.split(",")
    weights = zipf_weights(len(models), args.zipf)
    before = await asyncio.to_thread(scrape, args.gateway)
    rows: list[dict[str, Any]] = []
    t0, at, n, tasks = time.perf_counter(), 0.0, 0, []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while at < args.seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            turn = int(at // args.rotate) % len(models)  # who is most popular now
            order = models[turn:] + models[:turn]
            model = rng.choices(order, weights)[0]
            tasks.append(asyncio.create_task(one(session, args.gateway, model, n,
                                                 args.max_tokens)))
            n += 1
            at += rng.expovariate(args.rate)
        rows = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # the control plane's counts reach the workers
    after = await asyncio.to_thread(scrape, args.gateway)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if args.requests:
        await asyncio.to_thread(_append, args.requests,
                                "".join(json.dumps({"arm": name, **r}) + "\n" for r in rows))
    ok = [r for r in rows if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    waited = [t for t in ttfts if t > args.waited]

    def mean_of(state: str) -> float | None:
        count = summed(delta, "gateway_backend_state_seconds_count", state=state)
        total = summed(delta, "gateway_backend_state_seconds_sum", state=state)
        return round(total / count, 2) if count else None

    return {
        "arm": name, "requests": len(rows), "errors": len(rows) - len(ok),
        "error_samples": [r.get("error") or r["status"] for r in rows if not r["ok"]][:5],
        "per_model": dict(Counter(r["model"] for r in rows)),
        "requests_per_min": round(60 * len(ok) / wall, 1),
        "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p90_ms": pct(ttfts, 0.9),
        "ttft_p99_ms": pct(ttfts, 0.99), "waited": len(waited),
        "waited_ttft_p50_ms": pct(waited, 0.5), "waited_ttft_max_ms": pct(waited, 1.0),
        "sleeps": summed(delta, "gateway_backend_transitions_total", to="asleep"),
        "wakes": summed(delta, "gateway_backend_transitions_total", to="waking"),
        "wake_s_mean": mean_of("waking"), "verify_s_mean": mean_of("verifying"),
        "cold_starts": summed(delta, "gateway_backend_transitions_total", **{"from": "starting"}),
        "start_s_mean": mean_of("starting"),
        "wake_checks": {r: summed(delta, "gateway_backend_wake_checks_total", result=r)
                        for r in ("ok", "unchecked", "wrong_answer", "failed")},
        "gpu_memory_mib": nvml_span(args.nvml) if args.nvml else None,
    }


def nvml_span(path: str) -> dict[str, float] | None:
    """The least and most GPU memory used among ``nvidia-smi`` samples (MiB per line)."""
    try:
        used = [float(line.split(",")[-1]) for line in open(path) if line.strip()]
    except (OSError, ValueError):
        return None
    return {"min": min(used), "max": max(used)} if used else None


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| arm | requests/min | errors | TTFT p50 / p90 / p99 ms | waited: n, p50 / max ms "
          "| sleeps | wakes, mean s (+ check) | cold starts, mean s | wake checks | GPU MiB "
          "min / max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gpu = r.get("gpu_memory_mib") or {}
        print(f"| {r['arm']} | {r['requests_per_min']} | {r['errors']} of {r['requests']} | "
              f"{r['ttft_p50_ms']} / {r['ttft_p90_ms']} / {r['ttft_p99_ms']} | "
              f"{r['waited']}, {r['waited_ttft_p50_ms']} / {r['waited_ttft_max_ms']} | "
              f"{r['sleeps']:g} | {r['wakes']:g}, {r['wake_s_mean']} (+ {r['verify_s_mean']}) "
              f"| {r['cold_starts']:g}, {r['start_s_mean']} | "
              f"{', '.join(f'{k} {v:g}' for k, v in r['wake_checks'].items() if v)} | "
              f"{gpu.get('min', '-')} / {gpu.get('max', '-')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", default="http://127.0.0.1:9000")
    ap.add_argument("--models", default="a,b,c")
    ap.add_argument("--arm", default="arm")
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--rotate", type=float, default=60, help="seconds per popularity order")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--waited", type=float, default=1.0, help="TTFT (s) that means it waited")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--nvml", help="nvidia-smi samples taken during the arm")
    ap.add_argument("--out", default="sleep.jsonl")
    ap.add_argument("--requests", help="one line per request")
    ap.add_argument("--summary", help="print the table of a --out file")
    args = ap.parse_args()
    if args.summary:
        summary(args.summary)
        return
    result = asyncio.run(arm(args, args.arm))
    with open(args.out, "a") as out:
        out.write(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
