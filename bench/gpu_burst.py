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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request
from collections import defaultdict
from typing import Any

from bench.loadgen import Workload, raise_fd_limit, run

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


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after[name + "_count"] - before[name + "_count"]
    total = after[name + "_sum"] - before[name + "_sum"]
    return round(total / count * 1000, 2) if count else float("nan")


async def one_run(name: str, url: str, size: int, args: argparse.Namespace,
                  pids: list[int]) -> dict[str, Any]:
    work = Workload(args.model, True, args.tokens, None, args.sessions, 0, 1.0, ignore_eos=True)
    before, ticks, t0 = histograms(args.vllm), cpu_ticks(pids), time.perf_counter()
    result = await run([url], size, 1, work, warmup=0, timeout_s=args.timeout)
    wall = time.perf_counter() - t0
    after, ticks = histograms(args.vllm), cpu_ticks(pids) - ticks
    events = sum(int(k.split("/")[0]) * v for k, v in result.shapes.items())
    return {
        "target": name, "size": size, "errors": result.errors, "kinds": result.error_kinds,
        "ttft_p50": result.ttft_ms["p50"], "ttft_p99": result.ttft_ms["p99"],
        "ttft_mean": result.ttft_ms["mean"],
        "gap_max": result.gap_ms.get("max"), "tok_s": round(events / result.wall_s, 1),
        "vllm_ttft_mean": (inside := mean_ms(before, after, TTFT)),
        "front_mean": round(result.ttft_ms["mean"] - inside, 2),
        "vllm_queue_mean": mean_ms(before, after, QUEUE),
        "api_server_cores": round(ticks / TICKS / wall / max(1, len(pids)), 3),
    }


async def main_async(args: argparse.Namespace) -> None:
    targets = [("direct", args.vllm), *(t.split("=", 1) for t in args.target)]
    pids = [int(p) for p in args.api_server_pids.split(",") if p]
    with open(args.out, "a") as out:  # noqa: ASYNC230 (between runs, not during one)
        for repeat in range(args.start, args.start + args.repeats):
            for size in args.sizes:
                shift = repeat % len(targets)
                for name, url in targets[shift:] + targets[:shift]:
                    row = {"repeat": repeat, **await one_run(name, url, size, args, pids)}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), flush=True)
                    await asyncio.sleep(args.pause)


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
    parser.add_argument("--out", default="burst.jsonl")
    parser.add_argument("--summary", metavar="JSONL", help="only print the table of a file")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary)
        return
    raise_fd_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
