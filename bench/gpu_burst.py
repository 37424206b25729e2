"""Issue 18's burst on a GPU host: N concurrent streams of 256 tokens, all at once, against
one vLLM instance directly and through each proxy, interleaved with the order rotated every
repeat, with vLLM's own /metrics scraped before and after each run.

    python -m bench.gpu_burst --vllm http://127.0.0.1:8001 \
        --target gateway=http://127.0.0.1:9000 --target nginx=http://127.0.0.1:9100 \
        --target vllm-router=http://127.0.0.1:9200 --sizes 256 1024 --repeats 10 \
        --api-server-pids 123,124 --out runs.jsonl

Each run's line: the client's TTFT percentiles, largest inter-token gap and output tokens/s;
from vLLM's histograms over the run, its mean TTFT and queue time (the time inside vLLM, so
that time in front of it is told apart); and the cores vLLM's API-server processes used
(the check that vLLM's front end is not the bottleneck: under 0.8 core each). ``--summary``
prints the medians per target and size, and each proxy against direct in the same repeat.

The client (issue 37): ``--procs`` processes (4 by default) share each run's streams; each
opens a fresh connection per stream (none kept from an earlier run), every prompt is unique
(a random nonce first, so no two requests share a prefix-cache block, across runs and
targets too), and every other request carries an ``X-Session-ID`` of its own. The streams
start at one instant agreed by the processes. Per run it also records how many of the run's
connections each vLLM API-server process held (sampled from /proc one second in) and the
cores each used, so that an uneven spread over vLLM's API servers shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import statistics
import time
import urllib.request
from collections import Counter, defaultdict
from multiprocessing.connection import Connection
from typing import Any

import aiohttp

from bench.loadgen import Samples, Workload, _stream, percentiles, raise_fd_limit, run

TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"
TICKS = os.sysconf("SC_CLK_TCK")


def histograms(base: str) -> dict[str, float]:
    """The _sum and _count of vLLM's TTFT and queue-time histograms."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        for name in (TTFT, QUEUE):
            for part in ("_sum", "_count"):
                if line.startswith(name + part):
                    out[name + part] += float(line.split()[-1])
    return out


def cpu_ticks(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        out.append(int(fields[11]) + int(fields[12]))  # utime, stime
    return out


def connections_per_pid(pids: list[int], port: int) -> list[int]:
    """Established connections to ``port`` that each process holds (from /proc)."""
    established: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                established.add(f[9])
    counts = []
    for pid in pids:
        n = 0
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in established:
                    n += 1
        except OSError:
            pass
        counts.append(n)
    return counts


def mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after[name + "_count"] - before[name + "_count"]
    total = after[name + "_sum"] - before[name + "_sum"]
    return round(total / count * 1000, 2) if count else float("nan")


def unique_request(work: Workload, nonce: str, i: int) -> tuple[bytes, dict[str, str]]:
    """Stream i of a run: a prompt no other request shares, an X-Session-ID of its own on
    every other one."""
    fields: dict[str, object] = {
        "model": work.model, "stream": True, "max_tokens": work.tokens,
        "messages": [{"role": "user", "content": f"{nonce}-{i} benchmark prompt {i}"}]}
    if work.ignore_eos:
        fields["ignore_eos"] = True
    headers = {"content-type": "application/json"}
    if work.sessions and i % 2 == 0:
        headers["x-session-id"] = f"s-{nonce}-{i}"
    return json.dumps(fields).encode(), headers


async def _share(url: str, indices: list[int], work: Workload, nonce: str, at: float,
                 timeout_s: float) -> dict[str, Any]:
    """One client process's streams of a run, each on a fresh connection."""
    s = Samples()
    target = url.rstrip("/") + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        requests = [unique_request(work, nonce, i) for i in indices]
        await asyncio.sleep(max(0.0, at - time.time()))

        async def one(body: bytes, headers: dict[str, str]) -> None:
            try:
                await _stream(session, target, body, headers, s)
            except (aiohttp.ClientError, TimeoutError) as exc:
                s.errors[type(exc).__name__] += 1

        started = time.perf_counter()
        await asyncio.gather(*(one(b, h) for b, h in requests))
        wall = time.perf_counter() - started
    return {"ttft": s.ttft, "gap_max": max(s.gaps, default=0.0), "wall": wall,
            "shapes": [[e, b, c] for (e, b), c in s.shapes.items()], "errors": dict(s.errors)}


def _client_process(conn: Connection) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    raise_fd_limit()
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(asyncio.run(_share(*job)))


class Clients:
    """``n`` client processes, kept for the whole benchmark (their connections are not)."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipes: list[Connection] = []
        self.procs = []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(theirs,), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    async def burst(self, url: str, size: int, work: Workload,
                    timeout_s: float) -> tuple[list[float], float, float, Counter[tuple[int, int]],
                                               Counter[str]]:
        nonce = secrets.token_hex(6)
        at = time.time() + 0.2  # every process starts its streams at this instant
        n = len(self.pipes)
        for k, pipe in enumerate(self.pipes):
            pipe.send((url, list(range(k, size, n)), work, nonce, at, timeout_s))
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(None, p.recv) for p in self.pipes))
        ttft = [t for p in parts for t in p["ttft"]]
        shapes: Counter[tuple[int, int]] = Counter()
        errors: Counter[str] = Counter()
        for p in parts:
            for e, b, c in p["shapes"]:
                shapes[(e, b)] += c
            errors.update(p["errors"])
        return (ttft, max(p["gap_max"] for p in parts), max(p["wall"] for p in parts),
                shapes, errors)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(5)


async def one_run(name: str, url: str, size: int, args: argparse.Namespace,
                  pids: list[int], clients: Clients | None) -> dict[str, Any]:
    work = Workload(args.model, True, args.tokens, None, args.sessions, 0, 1.0, ignore_eos=True)
    before, ticks, t0 = histograms(args.vllm), cpu_ticks(pids), time.perf_counter()
    port = int(args.vllm.rstrip("/").rsplit(":", 1)[1])
    held: list[int] = []
    if clients is not None:
        async def sample() -> None:
            await asyncio.sleep(1.2)  # 0.2 s to the agreed start, then 1 s into the streams
            held.extend(connections_per_pid(pids, port))

        sampler = asyncio.ensure_future(sample())
        ttft_s, gap_max, run_wall, shapes, errors = await clients.burst(url, size, work,
                                                                         args.timeout)
        sampler.cancel()
        ttft_ms = percentiles(ttft_s)
        gap = round(gap_max * 1000, 3)
        n_errors, kinds = sum(errors.values()), dict(errors)
    else:
        result = await run([url], size, 1, work, warmup=0, timeout_s=args.timeout)
        ttft_ms, gap, run_wall = result.ttft_ms, result.gap_ms.get("max", 0.0), result.wall_s
        shapes = Counter()
        for key, v in result.shapes.items():
            e, b = key.split("/")
            shapes[(int(e), int(b))] = v
        n_errors, kinds = result.errors, result.error_kinds
    wall = time.perf_counter() - t0
    after = histograms(args.vllm)
    ticks = [b - a for a, b in zip(ticks, cpu_ticks(pids), strict=True)]
    events = sum(e * v for (e, _), v in shapes.items())
    cores = [round(t / TICKS / wall, 3) for t in ticks]
    return {
        "target": name, "size": size, "errors": n_errors, "kinds": kinds,
        "ttft_p50": ttft_ms["p50"], "ttft_p99": ttft_ms["p99"],
        "ttft_mean": ttft_ms["mean"],
        "gap_max": gap, "tok_s": round(events / run_wall, 1) if run_wall else 0.0,
        "vllm_ttft_mean": (inside := mean_ms(before, after, TTFT)),
        "front_mean": round(ttft_ms["mean"] - inside, 2),
        "vllm_queue_mean": mean_ms(before, after, QUEUE),
        "api_server_cores": max(cores, default=0.0),
        "api_server_cores_each": cores,
        "api_server_connections": held,
    }


async def main_async(args: argparse.Namespace, clients: Clients | None) -> None:
    targets = [("direct", args.vllm), *(t.split("=", 1) for t in args.target)]
    pids = [int(p) for p in args.api_server_pids.split(",") if p]
    try:
        with open(args.out, "a") as out:  # noqa: ASYNC230 (between runs, not during one)
            for repeat in range(args.start, args.start + args.repeats):
                for size in args.sizes:
                    shift = repeat % len(targets)
                    for name, url in targets[shift:] + targets[:shift]:
                        row = {"repeat": repeat,
                               **await one_run(name, url, size, args, pids, clients)}
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps(row), flush=True)
                        await asyncio.sleep(args.pause)
    finally:
        if clients is not None:
            clients.close()


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    direct = {(r["repeat"], r["size"]): r for r in rows if r["target"] == "direct"}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["target"], r["size"])].append(r)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 2) if xs else float("nan")

    print("| target | streams | runs | TTFT p50 / p99 ms | added p50 / p99 ms (median of "
          "per-repeat differences) | tok/s vs direct | max gap vs direct | vLLM TTFT / queue "
          "mean ms | API-server cores (max) | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (target, size), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = [direct.get((r["repeat"], size)) for r in rs]
        pairs = [(r, d) for r, d in zip(rs, base, strict=True) if d is not None]
        add50 = med([r["ttft_p50"] - d["ttft_p50"] for r, d in pairs])
        add99 = med([r["ttft_p99"] - d["ttft_p99"] for r, d in pairs])
        tok = med([r["tok_s"] / d["tok_s"] for r, d in pairs if d["tok_s"]])
        gap = med([r["gap_max"] / d["gap_max"] for r, d in pairs if d["gap_max"]])
        print(f"| {target} | {size} | {len(rs)} | {med([r['ttft_p50'] for r in rs])} / "
              f"{med([r['ttft_p99'] for r in rs])} | {add50:+} / {add99:+} | {tok} | {gap} | "
              f"{med([r['vllm_ttft_mean'] for r in rs])} / "
              f"{med([r['vllm_queue_mean'] for r in rs])} | "
              f"{max(r['api_server_cores'] for r in rs)} | {sum(r['errors'] for r in rs)} |")
    against(rows, med)


def against(rows: list[dict[str, Any]], med: Any) -> None:
    """The gateway against each peer in the same repeat: TTFT p50, p99, and the mean time in
    front of vLLM's engine (client mean TTFT minus vLLM's own mean TTFT over the run), which
    leaves out most of the engine's scheduling noise that swings one repeat's TTFT."""
    by = {(r["repeat"], r["size"], r["target"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    peers = sorted({r["target"] for r in rows} - {"gateway"})
    print("\n| gateway - peer (median of per-repeat differences; repeats the gateway was "
          "faster) | streams | TTFT p50 ms | TTFT p99 ms | time in front of vLLM ms |")
    print("|---|---|---|---|---|")
    for peer in peers:
        for size in sizes:
            pairs = [(g, by[(rep, size, peer)]) for (rep, sz, t), g in sorted(by.items())
                     if t == "gateway" and sz == size and (rep, size, peer) in by]
            cells = []
            for key in ("ttft_p50", "ttft_p99", "front_mean"):
                diffs = [g[key] - p[key] for g, p in pairs if key in g and key in p]
                won = sum(d < 0 for d in diffs)
                cells.append(f"{med(diffs):+} ({won}/{len(diffs)})" if diffs else "n/a")
            print(f"| gateway - {peer} | {size} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", help="the vLLM instance, direct")
    parser.add_argument("--target", action="append", default=[], help="NAME=URL, repeatable")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--start", type=int, default=0, help="the first repeat's number")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--model", default="test")
    parser.add_argument("--sessions", action="store_true", default=True)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between runs")
    parser.add_argument("--api-server-pids", default="", help="vLLM's API-server processes")
    parser.add_argument("--procs", type=int, default=4,
                        help="client processes, fresh connections and unique prompts each run "
                             "(0: the earlier one-process client, kept-alive prompts)")
    parser.add_argument("--out", default="burst.jsonl")
    parser.add_argument("--summary", metavar="JSONL", help="only print the table of a file")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary)
        return
    raise_fd_limit()
    clients = Clients(args.procs) if args.procs else None  # forked before any event loop
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args, clients))


if __name__ == "__main__":
    main()
