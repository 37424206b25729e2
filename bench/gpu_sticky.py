"""Issue 9's workload on real vLLM instances: multi-turn conversations with long system
prompts, replayed directly (the client pins each conversation to an instance itself: the
ideal), through vllm-gateway with sticky sessions, and through vllm-gateway with round
robin, interleaved. Prefix-cache hit ratio from each instance's /metrics, TTFT per turn.

    python -m bench.gpu_sticky --direct PORTS --sticky URL --rr URL [--rounds 2]

Modes run in the order direct, sticky, round_robin, repeated ``--rounds`` times, each
run with fresh conversations (its own seed), so no run finds another's prompts cached.
The same shape as shared/gpu/sticky_exp.py (the measured ideal), through the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
import urllib.request
from typing import Any

import aiohttp

WORDS = [f"w{i}" for i in range(3000)]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
               headers: dict[str, str]) -> tuple[float | None, str, int]:
    t0 = time.perf_counter()
    ttft, text, tokens = None, [], 0
    async with session.post(url + "/v1/chat/completions", headers=headers, json={
            "model": "test", "messages": messages, "max_tokens": 32, "temperature": 0,
            "stream": True}) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: ") or b"[DONE]" in line:
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            data = json.loads(line[6:])
            if "error" in data:
                return None, "", 0
            choices = data.get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                text.append(content)
                tokens += 1
    return ttft, "".join(text), tokens


async def run(mode: str, seed: int, targets: list[str], ports: list[int], nconv: int,
              turns: int, sys_words: int, conc: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ttfts: dict[int, list[float]] = {t: [] for t in range(turns)}
    errors, tokens = 0, 0
    sem = asyncio.Semaphore(conc)

    async def conversation(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal errors, tokens
        async with sem:
            messages = [{"role": "system",
                         "content": " ".join(rng.choice(WORDS) for _ in range(sys_words))}]
            for t in range(turns):
                messages.append({"role": "user",
                                 "content": " ".join(rng.choice(WORDS) for _ in range(60))})
                url = targets[i % len(targets)]  # direct: pinned by the client itself
                headers = {"x-session-id": f"{seed}-{i}"} if mode == "sticky" else {}
                try:
                    ttft, text, n = await turn(session, url, messages, headers)
                except aiohttp.ClientError:
                    ttft, text, n = None, "", 0
                if ttft is None:
                    errors += 1
                else:
                    ttfts[t].append(ttft)
                tokens += n
                messages.append({"role": "assistant", "content": text})

    q0 = sum(metric(p, "vllm:prefix_cache_queries_total") for p in ports)
    h0 = sum(metric(p, "vllm:prefix_cache_hits_total") for p in ports)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(conversation(i, session) for i in range(nconv)))
    wall = time.perf_counter() - t0
    q1 = sum(metric(p, "vllm:prefix_cache_queries_total") for p in ports)
    h1 = sum(metric(p, "vllm:prefix_cache_hits_total") for p in ports)
    first = sorted(ttfts[0])
    later = sorted(x for t in range(1, turns) for x in ttfts[t])
    return {"mode": mode, "seed": seed, "errors": errors,
            "hit_ratio": round((h1 - h0) / max(q1 - q0, 1), 3), "wall_s": round(wall, 1),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_first_p50_ms": round(pct(first, .5), 1),
            "ttft_first_p90_ms": round(pct(first, .9), 1),
            "ttft_first_p99_ms": round(pct(first, .99), 1),
            "ttft_later_p50_ms": round(pct(later, .5), 1),
            "ttft_later_p90_ms": round(pct(later, .9), 1),
            "ttft_later_p99_ms": round(pct(later, .99), 1)}


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--direct", required=True, help="comma-separated instance ports")
    ap.add_argument("--sticky", required=True, help="gateway URL with sticky sessions")
    ap.add_argument("--rr", required=True, help="gateway URL with round robin, no pins")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nconv", type=int, default=int(os.environ.get("NCONV", 64)))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--sys-words", type=int, default=int(os.environ.get("SYSW", 1500)))
    ap.add_argument("--conc", type=int, default=int(os.environ.get("CONC", 16)))
    ap.add_argument("--out", help="append one JSON line per run here")
    ap.add_argument("--seed-base", type=int, default=1000, help="fresh conversations per call")
    ap.add_argument("--modes", default="direct,sticky,round_robin")
    args = ap.parse_args()
    ports = [int(p) for p in args.direct.split(",")]
    direct = [f"http://127.0.0.1:{p}" for p in ports]
    plan = {m: t for m, t in (("direct", direct), ("sticky", [args.sticky]),
                                ("round_robin", [args.rr])) if m in args.modes.split(",")}
    await run("warmup", 99, direct, ports, 8, 2, 200, 8)
    for r in range(args.rounds):
        for m, (mode, targets) in enumerate(plan.items()):
            # Fresh conversations for every run: no run finds another's prompts cached.
            result = await run(mode, args.seed_base + 10 * r + m, targets, ports, args.nconv,
                               args.turns, args.sys_words, args.conc)
            result["round"] = r
            print(json.dumps(result), flush=True)
            if args.out:
                await asyncio.to_thread(_append, args.out, json.dumps(result) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
