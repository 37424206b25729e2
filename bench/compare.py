"""The whole comparison: direct, vllm-gateway, nginx, vllm-router and LiteLLM on the same
simulated backends, interleaved rounds, medians. Writes docs/BENCHMARKS.md and a plot.

    bash bench/install_peers.sh          # once: nginx, vllm-router, litellm
    .venv/bin/python -m bench.compare    # ~12 minutes on 2 cores

    # a change against the commit before it, interleaved round by round:
    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m bench.compare --baseline /tmp/before --rounds 4 --levels 256 \
        --targets direct "vllm-gateway default" --out /tmp/ab.md --raw /tmp/ab.json

The gateway runs twice: in the default configuration (config.toml as shipped, url backends
on the simulators) and trimmed (bench.targets.TRIMMED: no Redis, no access log).

Each proxy runs alone on core 0; two simulators and the load generator share core 1.
A latency phase whose load core was saturated (>95 % busy) is marked and fails the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import report, scaling, targets
from bench.common import (
    HAVE_TASKSET,
    LOAD_CORE,
    PROXY_CORE,
    count_lines,
    cpu_seconds,
    free_port,
    loadgen,
    metric,
    rss_peak_mb,
    sim_argv,
    start,
    stop,
    wait_http,
)

Starter = Callable[[list[str], Path], targets.Running]
SATURATED = 0.95
ITL = 0.02  # the simulators' gap between chunks, seconds


def direct(sims: list[str], tmp: Path) -> targets.Running:
    return targets.Running("direct", sims, None)


def gateway_trimmed_2w(sims: list[str], tmp: Path) -> targets.Running:
    # Two workers need two cores: this one shares core 1 with the load, stated in the output.
    # The default features need a shared redis:// URL with two workers, hence trimmed only.
    return targets.gateway(sims, tmp, workers=2, core=f"{PROXY_CORE},{LOAD_CORE}")


STARTERS: dict[str, Starter] = {
    "direct": direct,
    "vllm-gateway default": targets.gateway_default,
    "vllm-gateway trimmed": targets.gateway,
    "vllm-gateway trimmed x2": gateway_trimmed_2w,
    "nginx": targets.nginx,
    "vllm-router": targets.vllm_router,
    "litellm": targets.litellm,
}
# Every request of every phase, to every target: cacheable (temperature 0), and every other
# one in a session, so the default gateway pins and keeps replies as it would in service.
BASELINE = "vllm-gateway default (baseline)"
WORKLOAD = ("--temperature", "0", "--sessions")
REDIS_DOWN = "redis unavailable"


def redis_record(run: targets.Running) -> dict[str, float]:
    """What the gateway's Redis link went through during the run (before it stops)."""
    return {"redis_errors": metric(run.urls[0], "gateway_redis_errors_total"),
            "redis_unavailable_lines": count_lines(run.log, REDIS_DOWN) if run.log else 0,
            "sticky_routed": metric(run.urls[0], "gateway_sticky_total")}


def setup_text(rounds: int, redis: dict[str, list[dict[str, float]]], elapsed: float) -> str:
    trimmed = ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in targets.TRIMMED.items())
    seen = "; ".join(
        f"{name}, per round: `gateway_redis_errors_total` "
        + ", ".join(str(int(r["redis_errors"])) for r in rs) + f"; '{REDIS_DOWN}' log lines "
        + ", ".join(str(int(r["redis_unavailable_lines"])) for r in rs)
        for name, rs in redis.items())
    return (f"{rounds} interleaved rounds, medians; proxies pinned to core {PROXY_CORE}, "
            f"2 simulators and the load generator to core {LOAD_CORE}"
            + ("" if HAVE_TASKSET else " (NOT pinned: taskset missing)")
            + ". Every request carries `temperature: 0` and every other one an `X-Session-ID` "
            "(one session per load worker); only the default gateway acts on them. "
            "**vllm-gateway default** is `config.toml` as shipped (embedded Redis, sticky "
            "routing, reply cache, shared breakers, `log_level = \"info\"` with the access "
            "log, json log), its two spawned vLLM backends replaced by url backends on the "
            "simulators (they stand in for vLLM: this measures the proxy, not the model). "
            f"**vllm-gateway trimmed** is the same with {trimmed}: no Redis at all and no "
            "access-log lines. 'vllm-gateway trimmed x2' is trimmed with `workers = 2` on "
            f"both cores, so it shares core {LOAD_CORE} with the load. The default gateway, "
            f"pinned to core {PROXY_CORE}, runs `workers = \"auto\"` as one process (one "
            "usable core)"
            + (f"; {seen}" if seen else "")
            + f"; suite took {elapsed / 60:.1f} min")


class Bench:
    def __init__(self, args: argparse.Namespace, sims: list[str], sim_pids: list[int]) -> None:
        self.args = args
        self.sims = sims
        self.sim_pids = sim_pids
        # The client's manners: fresh connections, prompts of their own (default: neither).
        self.client = ((*(["--fresh"] if args.fresh else []),
                        "--unique-share", str(args.unique_share)))

    def phase(self, run: targets.Running, concurrency: int, requests: int, tokens: int,
              *extra: str) -> dict[str, object]:
        proxy_cpu = cpu_seconds(run.proc.pid) if run.proc else 0.0
        sims_cpu = sum(cpu_seconds(p) for p in self.sim_pids)
        t0 = time.perf_counter()
        result = loadgen(run.urls, concurrency, requests, tokens, *WORKLOAD, *self.client,
                         *extra)
        wall = time.perf_counter() - t0
        sims_cpu = sum(cpu_seconds(p) for p in self.sim_pids) - sims_cpu
        result["proxy_cpu_s"] = (cpu_seconds(run.proc.pid) - proxy_cpu) if run.proc else 0.0
        # The measured part is shorter than the subprocess's life; this errs on the busy side.
        result["load_core_busy"] = round((float(result["cpu_s"]) + sims_cpu)  # type: ignore[arg-type]
                                         / float(result["wall_s"]), 3)  # type: ignore[arg-type]
        result["phase_wall_s"] = round(wall, 2)
        return result

    def latency(self, run: targets.Running) -> dict[str, dict[str, object]]:
        a = self.args
        # c64: 64 streams open at any moment, arrivals evenly spaced over one stream's length
        # (64 chunks x 20 ms); burst: 64 streams that all start in the same instant.
        return {
            "c1": self.phase(run, 1, a.c1_requests, 8, "--warmup", "3"),
            "c64": self.phase(run, 64, a.c64_requests, 64, "--spread", str(64 * ITL)),
            "burst": self.phase(run, 64, a.burst_requests, 8),
            "plain": self.phase(run, 64, a.plain_requests, 8, "--no-stream", "--model",
                                "quick-model", "--warmup", "2"),
        }

    def capacity(self, run: targets.Running) -> dict[str, object]:
        held = 0
        levels: dict[str, object] = {}
        for level in self.args.levels:
            r = self.phase(run, level, 1, 8, "--model", "hold-model", "--warmup", "0",
                           "--timeout", "30")
            levels[str(level)] = {"errors": r["errors"], "kinds": r["error_kinds"]}
            if r["errors"]:
                break
            held = level
        rss = rss_peak_mb(run.proc.pid) if run.proc else 0.0
        return {"held": held, "levels": levels, "rss_peak_mb": rss}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--targets", nargs="+", default=list(STARTERS))
    parser.add_argument("--levels", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--c1-requests", type=int, default=30)
    parser.add_argument("--c64-requests", type=int, default=4)
    parser.add_argument("--burst-requests", type=int, default=3)
    parser.add_argument("--plain-requests", type=int, default=20)
    parser.add_argument("--fresh", action="store_true",
                        help="the load opens a new connection per request (none kept alive)")
    parser.add_argument("--unique-share", type=float, default=0.0,
                        help="share of requests with a prompt of their own")
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--raw", type=Path, default=Path("bench/results/compare.json"))
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="another checkout of this repository (e.g. a git worktree of the "
                             "commit before a change): its gateway, default config, is measured "
                             f"as '{BASELINE}' in every round beside this one")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long check: direct and both gateways, tiny loads, no docs")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite docs/BENCHMARKS.md from --raw without measuring")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.levels = 1, [16]
        args.targets = ["direct", "vllm-gateway default", "vllm-gateway trimmed"]
        args.c1_requests, args.c64_requests, args.plain_requests = 3, 1, 1
        args.burst_requests = 1
    if args.baseline is not None:
        checkout = args.baseline.resolve()
        if not (checkout / "gateway" / "__init__.py").is_file():
            parser.error(f"--baseline {checkout}: not a checkout of this repository")
        STARTERS[BASELINE] = lambda sims, tmp: dataclasses.replace(
            targets.gateway(sims, tmp, trimmed=False, repo=checkout), name=BASELINE)
        if BASELINE not in args.targets:
            args.targets.insert(args.targets.index("vllm-gateway default") if
                                "vllm-gateway default" in args.targets else 0, BASELINE)
    return args


Rounds = dict[str, list[dict[str, dict[str, object]]]]


def measure(args: argparse.Namespace, tmp: Path) -> tuple[Rounds, dict[str, dict[str, object]],
                                                          dict[str, list[dict[str, float]]]]:
    """Every target, round after round, on the same two simulators."""
    ports = [free_port(), free_port()]
    sims = [f"http://127.0.0.1:{p}" for p in ports]
    models = ["--model", "sim-model", "--model", "hold-model:itl=0.5",
              "--model", "quick-model:itl=0"]
    procs = [start(LOAD_CORE, sim_argv(p, ITL, *models), tmp / f"sim{p}.log") for p in ports]
    rounds: Rounds = {t: [] for t in args.targets}
    capacity: dict[str, dict[str, object]] = {}
    redis: dict[str, list[dict[str, float]]] = {}
    try:
        for url in sims:
            wait_http(url + "/health")
        bench = Bench(args, sims, [p.pid for p in procs])
        for r in range(args.rounds):
            for name in args.targets:
                run = STARTERS[name](sims, tmp)
                try:
                    rounds[name].append(bench.latency(run))
                    if r == args.rounds - 1:
                        capacity[name] = bench.capacity(run)
                    if name.startswith("vllm-gateway default"):
                        redis.setdefault(name, []).append(redis_record(run))
                finally:
                    if run.proc:
                        stop(run.proc)
                print(f"round {r + 1}: {name} done", file=sys.stderr)
    finally:
        for p in procs:
            stop(p)
    return rounds, capacity, redis


def verdict(args: argparse.Namespace, rounds: Rounds, summary: dict[str, dict[str, object]],
            workers: dict[str, object] | None) -> int:
    saturated = [f"{t} {p}" for t, rs in rounds.items() for rr in rs for p, v in rr.items()
                 if p != "plain" and float(v["load_core_busy"]) > SATURATED]  # type: ignore[arg-type]
    if workers and workers["summary"]["1 worker"]["load_core_busy"] > SATURATED:  # type: ignore[index]
        saturated.append("scaling, 1 worker")
    mismatched = [t for t, s in summary.items() if not s["shapes_match"]]
    if saturated and not args.smoke:
        print(f"REJECTED: load core saturated in {saturated}", file=sys.stderr)
        return 3
    if args.smoke and mismatched:
        print(f"chunk counts differ from direct: {mismatched}", file=sys.stderr)
        return 4
    return 0


def main() -> int:
    args = arguments()
    if args.report_only:
        raw = json.loads(args.raw.read_text())
        summary = report.summarise(raw["rounds"], raw["capacity"])
        report.write(args.out, raw["setup"], summary, raw.get("argv", []), raw.get("scaling"))
        return 0
    missing = [t for t, ok in targets.available().items() if t in args.targets and not ok]
    if not args.smoke and importlib.util.find_spec("matplotlib") is None:
        missing.append("matplotlib (the plot)")
    if missing:
        print(f"missing peers {missing}: run bash bench/install_peers.sh", file=sys.stderr)
        return 2
    started = time.monotonic()
    rounds, capacity, redis = measure(args, Path(tempfile.mkdtemp(prefix="vgw-compare-")))
    workers = None
    if "vllm-gateway trimmed" in args.targets and scaling.available():
        workers = scaling.run(args.rounds, seconds=2 if args.smoke else 5)
        print("scaling done", file=sys.stderr)
    setup = setup_text(args.rounds, redis, time.monotonic() - started)
    summary = report.summarise(rounds, capacity)
    raw = {"setup": setup, "summary": summary, "rounds": rounds, "capacity": capacity,
           "redis": redis, "scaling": workers, "argv": sys.argv[1:]}
    if not args.smoke:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps(raw, indent=1))
        report.write(args.out, setup, summary, sys.argv[1:], workers)
    print(json.dumps({"summary": summary, "redis": redis}, indent=1))
    return verdict(args, rounds, summary, workers)


if __name__ == "__main__":
    sys.exit(main())
