"""The gateway's upstream clients (httptools, aiohttp, httpx) against each other, on
concurrent streams.

Two simulators and the load generator share one core; the gateway has the other.
Rounds are interleaved (direct, httptools, aiohttp, direct, ...) and medians reported.
httpx is left out unless named (``--modes``): at 256 streams it queues for a minute.

    python -m bench.upstream_clients --rounds 3 --concurrency 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import (
    HAVE_TASKSET,
    LOAD_CORE,
    PROXY_CORE,
    cpu_seconds,
    free_port,
    loadgen,
    sim_argv,
    start,
    stop,
    wait_http,
)

MODES = ("direct", "httptools", "aiohttp", "httpx")


def gateway_config(port: int, client: str, sims: list[str]) -> str:
    backends = "".join(
        f'\n[[backends]]\nname = "s{i}"\nurl = "{url}"\n' for i, url in enumerate(sims)
    )
    return (f'[gateway]\nlisten = "127.0.0.1:{port}"\nlog_level = "warning"\n'
            f'[upstream]\nclient = "{client}"\n' + backends)


def one_round(mode: str, sims: list[str], tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    if mode == "direct":
        result = loadgen(sims, args.concurrency, args.requests, args.tokens)
        cpu = 0.0
    else:
        port = free_port()
        cfg = tmp / f"{mode}.toml"
        cfg.write_text(gateway_config(port, mode, sims))
        gw = start(PROXY_CORE, [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
                   tmp / f"gw-{mode}.log")
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz")
            before = cpu_seconds(gw.pid)
            result = loadgen([f"http://127.0.0.1:{port}"], args.concurrency, args.requests,
                             args.tokens)
            cpu = cpu_seconds(gw.pid) - before
        finally:
            stop(gw)
    n = float(result["requests"])  # type: ignore[arg-type]
    ttft = result["ttft_ms"]
    return {
        "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"],  # type: ignore[index]
        "total_p50": result["total_ms"]["p50"],  # type: ignore[index]
        "rps": float(result["rps"]),  # type: ignore[arg-type]
        "errors": float(result["errors"]),  # type: ignore[arg-type]
        "cpu_ms_per_stream": round(cpu / n * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4, help="streams per worker per round")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--itl", type=float, default=0.02)
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        default=["direct", "httptools", "aiohttp"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/upstream_clients.json"))
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vgw-bench-"))
    ports = [free_port(), free_port()]
    sims = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start(LOAD_CORE, sim_argv(p, args.itl), tmp / f"sim{p}.log") for p in ports]
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    try:
        for url in sims:
            wait_http(url + "/health")
        for r in range(args.rounds):
            for mode in args.modes:
                rounds[mode].append(one_round(mode, sims, tmp, args))
                print(f"round {r + 1} {mode}: {rounds[mode][-1]}", file=sys.stderr)
    finally:
        for p in procs:
            stop(p)
    medians = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for m, rs in rounds.items()}
    setup = (f"{args.concurrency} concurrent streams x {args.requests} each, {args.tokens} "
             f"tokens {args.itl * 1000:g} ms apart, 2 simulators, {args.rounds} interleaved "
             f"rounds, medians; gateway pinned to core {PROXY_CORE}, simulators and load "
             f"generator to core {LOAD_CORE}" + ("" if HAVE_TASKSET else " (NOT pinned)"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": setup, "medians": medians, "rounds": rounds},
                                   indent=1))
    print(setup)
    print("| mode | TTFT p50 ms | TTFT p99 ms | stream p50 ms | streams/s | errors | "
          "gateway CPU ms/stream |")
    print("|---|---|---|---|---|---|---|")
    for mode, m in medians.items():
        print(f"| {mode} | {m['ttft_p50']:.2f} | {m['ttft_p99']:.2f} | {m['total_p50']:.1f} | "
              f"{m['rps']:.0f} | {m['errors']:.0f} | {m['cpu_ms_per_stream']:.3f} |")


if __name__ == "__main__":
    main()
