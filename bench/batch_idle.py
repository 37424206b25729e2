"""Issue 40 point 5: does a batch run only in the capacity interactive traffic leaves idle?

Two simulators with vLLM's capacity model (``--capacity``: that many at once, the rest wait
in its own queue), each behind the gateway as a url backend held to the same capacity
(``max_concurrent``, as a spawned vLLM's ``max_num_seqs`` is), the gateway otherwise in its
default config (a worker per core, embedded Redis). Interactive load: streamed chat
completions at Poisson arrivals of ``--share`` of the capacity's throughput. Run A: that
load alone; run B: the same load while a batch of ``--lines`` lines runs (started first,
flowing before the load begins). Per run: the interactive requests' TTFT p50/p99 (first
content chunk); in B, the batch lines completed during the load window, against the
capacity the load leaves idle.

    python -m bench.batch_idle --seconds 60 --lines 10000 --out bench/results/batch_idle.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import openai
import orjson

from bench.common import free_port, metric, start, stop, wait_http
from bench.loadgen import percentiles

CAPACITY = 8  # per simulator
TTFT, ITL, TOKENS = 0.1, 0.01, 16  # each request holds a place TTFT + (TOKENS - 1) x ITL


async def interactive(url: str, rate: float, seconds: float) -> list[float]:
    """Poisson arrivals of streamed chat completions; each one's TTFT (s)."""
    ttfts: list[float] = []
    errors = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors
        body = orjson.dumps({"model": "sim-model", "stream": True, "max_tokens": TOKENS,
                             "messages": [{"role": "user", "content": f"interactive {i}"}]})
        began = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                errors += 1
                await r.read()
                return
            first = None
            async for _ in r.content.iter_any():
                first = first or time.perf_counter()
            ttfts.append((first or time.perf_counter()) - began)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, rng, at = [], random.Random(7), time.perf_counter()
        end, i = at + seconds, 0
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, i)))
            i += 1
        await asyncio.gather(*tasks)
    if errors:
        print(f"  {errors} interactive errors", file=sys.stderr)
    return ttfts


def batch_lines(n: int) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": TOKENS,
                 "messages": [{"role": "user", "content": f"batch line {i}"}]}}) + b"\n"
        for i in range(n))


def run(work: Path, seconds: float, share: float, lines: int,
        concurrency: int | None) -> dict[str, object]:
    sims, procs = [], []
    for n in range(2):
        port = free_port()
        procs.append(start(None, [sys.executable, "-m", "gateway", "sim", "--port", str(port),
                                  "--capacity", str(CAPACITY), "--ttft", str(TTFT), "--itl",
                                  str(ITL), "--tokens", str(TOKENS)], work / f"sim{n}.log"))
        sims.append(f"http://127.0.0.1:{port}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = work / "gw.toml"
    config.write_text(
        f'[gateway]\nlisten = "127.0.0.1:{port}"\n[redis]\ndata_dir = "{work}/valkey"\n'
        f'[batch]\ndir = "{work}/batch"\n'
        + (f"concurrency = {concurrency}\n" if concurrency else "") + "".join(
            f'[[backends]]\nname = "s{n}"\nurl = "{u}"\nmax_concurrent = {CAPACITY}\n'
            for n, u in enumerate(sims)))
    gw = start(None, [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
               work / "gw.log")
    procs.append(gw)
    try:
        for u in [*sims, url]:
            wait_http(u + ("/readyz" if u == url else "/health"), 60)
        throughput = 2 * CAPACITY / (TTFT + (TOKENS - 1) * ITL)  # requests/s at capacity
        rate = share * throughput
        alone = asyncio.run(interactive(url, rate, seconds))
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        source = client.files.create(file=("b.jsonl", io.BytesIO(batch_lines(lines))),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        while metric(url, "gateway_batch_lines_total") < 50:
            time.sleep(0.2)
        before, began = metric(url, "gateway_batch_lines_total"), time.monotonic()
        beside = asyncio.run(interactive(url, rate, seconds))
        done = metric(url, "gateway_batch_lines_total") - before
        window = time.monotonic() - began
        client.batches.cancel(batch.id)
        idle = throughput - rate
        a, b = percentiles(alone), percentiles(beside)
        return {
            "concurrency": concurrency or "default", "capacity_rps": round(throughput, 1),
            "interactive_rps": round(rate, 1), "seconds": seconds, "lines": lines,
            "alone": {"n": len(alone), "ttft_p50_ms": round(a["p50"], 1),
                      "ttft_p99_ms": round(a["p99"], 1)},
            "with_batch": {"n": len(beside), "ttft_p50_ms": round(b["p50"], 1),
                           "ttft_p99_ms": round(b["p99"], 1)},
            "batch_lines_per_s": round(done / window, 1),
            "idle_capacity_rps": round(idle, 1),
            "batch_share_of_idle": round(done / window / idle, 3),
            "mean_ttft_ms": {"alone": round(a["mean"], 1), "with_batch": round(b["mean"], 1)}}
    finally:
        for p in procs:
            stop(p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--share", type=float, default=0.7)
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, help="[batch] concurrency (default: "
                        "the gateway's)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the logs and files in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-idle-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(work, args.seconds, args.share, args.lines, args.concurrency)
        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
