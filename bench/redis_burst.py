"""The Redis path under a burst: the gateway in its default configuration (config.toml as
shipped: embedded Redis, sticky routing, reply cache, shared breakers, access log) in
front of several simulators standing in for vLLM, and one burst of concurrent streams.

Every stream is a temperature-0 chat completion (so its reply is kept in the reply cache);
every other one carries an ``X-Session-ID`` from a pool of sessions (new pins and hits);
half the prompts repeat one prompt, the rest are unique. Reports completed and failed
streams, TTFT, ``gateway_redis_errors_total`` before and after (from /metrics) and the
gateway log's "redis unavailable" lines; writes bench/results/redis_burst.json and its
section of docs/BENCHMARKS.md.

    .venv/bin/python -m bench.redis_burst --streams 256     # a first look
    .venv/bin/python -m bench.redis_burst                   # 2,048 streams

Nothing is pinned to a core: client, gateway, its valkey and the simulators share them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import targets
from bench.common import (
    REPO,
    count_lines,
    free_port,
    loadgen,
    metric,
    sim_argv,
    start,
    stop,
    wait_http,
)

START, END = "<!-- redis-burst:start -->", "<!-- redis-burst:end -->"
DOWN, BACK = "redis unavailable", "redis answers again"
COUNTERS = ("gateway_redis_errors_total", "gateway_reply_cache_dropped_total")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2048, help="concurrent, all at once")
    parser.add_argument("--sims", type=int, default=4)
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--itl", type=float, default=0.005)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--session-pool", type=int, default=256, help="distinct sessions")
    parser.add_argument("--unique-share", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=120, help="seconds per stream")
    parser.add_argument("--trimmed", action="store_true",
                        help="the control: the gateway trimmed (bench.targets.TRIMMED, no Redis)")
    parser.add_argument("--commit", help="the commit measured, when not run in a git checkout")
    parser.add_argument("--raw", type=Path, default=Path("bench/results/redis_burst.json"))
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--no-docs", action="store_true", help="print the section instead")
    parser.add_argument("--report-only", action="store_true",
                        help="write the section from --raw without measuring")
    return parser.parse_args()


def commit(given: str | None) -> str:
    if given:
        return given
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "gateway", "backends"], check=True, capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes in gateway/ or backends/" if dirty else "")


def wait_routable(url: str, backends: int, timeout: float = 30) -> None:
    """Every backend probed ready, so the burst is spread over all of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = httpx.get(url + "/readyz", timeout=2).json().get("backends", {})
        if len(states) == backends and all(s == "ready" for s in states.values()):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not every backend ready after {timeout} s")


def counters(url: str) -> dict[str, float]:
    return {name: metric(url, name) for name in COUNTERS}


def log_figures(log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace") if log.exists() else ""
    kinds = Counter(re.findall(DOWN + r" \((\w+)", text))
    lines = [line for line in text.splitlines() if DOWN in line]
    return {"redis_unavailable_lines": count_lines(log, DOWN),
            "redis_back_lines": count_lines(log, BACK), "redis_error_kinds": dict(kinds),
            "redis_unavailable_messages": lines[:5]}


def burst(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(args.sims)]
    sims = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start(None, [*sim_argv(p, args.itl), "--ttft", str(args.ttft), "--tokens",
                          str(args.tokens)], tmp / f"sim{p}.log") for p in ports]
    try:
        for url in sims:
            wait_http(url + "/health")
        run = targets.gateway(sims, tmp, core=None, trimmed=args.trimmed)
        assert run.proc is not None and run.log is not None
        try:
            url = run.urls[0]
            wait_routable(url, args.sims)
            before, lines_before = counters(url), count_lines(run.log, DOWN)
            load = loadgen(
                [url], args.streams, 1, args.tokens, "--warmup", "0", "--temperature", "0",
                "--sessions", "--session-pool", str(args.session_pool), "--unique-share",
                str(args.unique_share), "--timeout", str(args.timeout), core=None)
            after = counters(url)
            sticky = {k: metric(url, f'gateway_sticky_total{{result="{k}"}}')
                      for k in ("hit", "miss", "repin", "fallback")}
        finally:
            stop(run.proc)
        logged = log_figures(run.log)
        if lines_before:
            logged["redis_unavailable_before_burst"] = lines_before
    finally:
        for p in procs:
            stop(p)
    return {"load": load, "before": before, "after": after, "sticky": sticky, **logged}


def measuring_argv(argv: list[str]) -> list[str]:
    """The command line less where results go: what the docs show as the command."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.split("=")[0] in ("--raw", "--out", "--commit"):
            skip = "=" not in a
        elif a != "--no-docs":
            out.append(a)
    return out


def summarise(args: argparse.Namespace, measured: dict[str, Any], took: float) -> dict[str, Any]:
    load, before, after = measured["load"], measured["before"], measured["after"]
    errors = "gateway_redis_errors_total"
    return {
        "commit": commit(args.commit),
        "date": datetime.date.today().isoformat(),
        "argv": measuring_argv(sys.argv[1:]),
        "config": "trimmed" if args.trimmed else "default",
        "streams": args.streams,
        "completed": load["requests"] - load["errors"],
        "failed": load["errors"],
        "failure_kinds": load["error_kinds"],
        "ttft_ms": load["ttft_ms"],
        "gap_ms": load["gap_ms"],
        "redis_errors_before": before[errors],
        "redis_errors_after": after[errors],
        "reply_cache_dropped": after["gateway_reply_cache_dropped_total"]
        - before["gateway_reply_cache_dropped_total"],
        "sticky": measured["sticky"],
        **{k: v for k, v in measured.items() if k.startswith("redis_")},
        "setup": (f"{args.sims} simulators (`--ttft {args.ttft} --itl {args.itl} --tokens "
                  f"{args.tokens}`), {args.streams} streams started at once, every other one "
                  f"with an X-Session-ID from {args.session_pool} sessions, "
                  f"{args.unique_share:.0%} of prompts unique, the rest one repeated prompt; "
                  f"took {took:.0f} s"),
    }


def describe(r: dict[str, Any]) -> str:
    if r.get("config", "default") == "trimmed":
        changes = ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in targets.TRIMMED.items())
        gateway = (f"The gateway **trimmed**, as a control (`config.toml` as shipped with "
                   f"{changes}: no Redis)")
    else:
        gateway = ("The gateway in its **default configuration** (`config.toml` as shipped: "
                   "embedded Redis, sticky routing, reply cache, shared breakers, access log "
                   "at `info`, json log)")
    return (
        f"{gateway}, its spawned vLLM backends replaced by url backends on simulators "
        f"standing in for vLLM: {r['setup']}. Every request is a temperature-0 chat "
        "completion, so every reply goes to the reply cache. Client (`bench.loadgen`, "
        "aiohttp), gateway, its valkey and the simulators share this machine's 2 cores, "
        "unpinned, so TTFT here is the whole machine's queueing, not the gateway's overhead. "
        f"Measured on commit `{r['commit']}`, {r['date']}.")


def section(r: dict[str, Any]) -> str:
    command = " ".join([".venv/bin/python -m bench.redis_burst", *r["argv"]])
    delta = r["redis_errors_after"] - r["redis_errors_before"]
    kinds = ", ".join(f"{k} {v}" for k, v in r["redis_error_kinds"].items()) or "none"
    met = delta == 0 and r["redis_unavailable_lines"] == 0 and r["failed"] == 0
    verdict = ("not measured at 2,048" if r["streams"] < 2048 or r.get("config") == "trimmed"
               else "met" if met else "**not met**")
    return (
        f"{START}\n```bash\n{command}\n```\n\n{describe(r)}\n\n"
        "| streams | completed | failed | TTFT p50 / p99 ms | `gateway_redis_errors_total` "
        "before → after | 'redis unavailable' log lines | Redis errors by kind "
        "| pins: new / hit / fallback | reply-cache writes dropped |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {r['streams']} | {r['completed']} | {r['failed']} "
        f"| {r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p99']:.1f} "
        f"| {r['redis_errors_before']:.0f} → {r['redis_errors_after']:.0f} "
        f"| {r['redis_unavailable_lines']} | {kinds} "
        f"| {r['sticky']['miss']:.0f} / {r['sticky']['hit']:.0f} / {r['sticky']['fallback']:.0f} "
        f"| {r['reply_cache_dropped']:.0f} |\n\n"
        "Goal (issue 16): at 2,048 concurrent streams in the default configuration, no "
        f"Redis error and no failed stream: {verdict}.\n"
        + END
    )


def write(doc: Path, text: str) -> None:
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if START in old and END in old:
        new = old[: old.index(START)] + text + old[old.index(END) + len(END):]
    else:
        new = old + "\n## Redis under a burst of concurrent streams (issue 16)\n\n" + text + "\n"
    doc.write_text(new)


def main() -> int:
    args = arguments()
    if args.report_only:
        result = json.loads(args.raw.read_text())
    else:
        started = time.monotonic()
        measured = burst(args, Path(tempfile.mkdtemp(prefix="vgw-redis-burst-")))
        result = summarise(args, measured, time.monotonic() - started)
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps(result, indent=1))
    text = section(result)
    if args.no_docs:
        print(text, file=sys.stderr)
    else:
        write(args.out, text)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
