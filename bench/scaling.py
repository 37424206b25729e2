"""Worker scaling: one gateway worker against two, with a load side too cheap to matter.

On a 2-core machine the Python simulator and load generator saturate their core long
before two gateway workers would (see the comparison's non-stream phase), so this phase
swaps both for C: ``wrk`` sends the requests and an nginx serving a fixed chat completion
plays the backend, together on the load core. One worker runs on the proxy core; two
workers get both cores and share the load core with wrk and nginx (stated in the output).

    .venv/bin/python -m bench.scaling --rounds 3

On a host with cores to spare (issue 18's GPU host), more workers, the default config and
the load on cores of its own:

    python -m bench.scaling --workers 1 4 --default --proxy-cores 0-3 --load-cores 4-15 \
        --threads 8 --connections 256 --nginx-workers 4
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import targets
from bench.common import (
    LOAD_CORE,
    PROXY_CORE,
    cpu_seconds,
    free_port,
    pinned,
    start,
    stop,
    wait_http,
)

MODEL = "quick-model"
REPLY = json.dumps({
    "id": "chatcmpl-static", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9},
})
BODY = json.dumps({"model": MODEL, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "benchmark"}]})


# Found on the PATH, or where bench/gpu unpacks Debian's packages on a host without them.
WRK = shutil.which("wrk") or "/tmp/debs/usr/bin/wrk"
NGINX = shutil.which("nginx") or "/tmp/nginx/usr/sbin/nginx"


def available() -> bool:
    return Path(WRK).exists() and Path(NGINX).exists()


@dataclass(frozen=True)
class Layout:
    """Where each side runs: the gateway's workers take the first n of ``proxy`` (a taskset
    list; with one listed core, two workers also get the load core, as on 2 cores)."""

    proxy: str = PROXY_CORE
    load: str = LOAD_CORE
    threads: int = 1  # wrk's
    nginx_workers: int = 1

    def gateway(self, workers: int) -> str:
        cores = expand(self.proxy)
        if workers <= len(cores):
            return ",".join(cores[:workers])
        return f"{self.proxy},{self.load}"


def expand(cores: str) -> list[str]:
    out: list[str] = []
    for part in cores.split(","):
        first, _, last = part.partition("-")
        out.extend(str(c) for c in range(int(first), int(last or first) + 1))
    return out


def static_backend(tmp: Path, layout: Layout = Layout()) -> tuple[str, subprocess.Popen[bytes]]:
    """nginx answering /health, /v1/models and every chat completion with one fixed reply."""
    port = free_port()
    prefix = tmp / "static"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
    (prefix / "nginx.conf").write_text(f"""
worker_processes {layout.nginx_workers};
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    default_type application/json;
    location = /health {{ return 200 "ok"; }}
    location = /v1/models {{ return 200 '{models}'; }}
    location = /v1/chat/completions {{ return 200 '{REPLY}'; }}
  }}
}}
""")
    proc = start(layout.load, [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                             "-g", "daemon off;"], tmp / "static.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return url, proc


def wrk(url: str, seconds: int, connections: int, tmp: Path,
        layout: Layout = Layout()) -> dict[str, Any]:
    script = tmp / "post.lua"
    script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\n'
                      'wrk.headers["Content-Type"] = "application/json"\n')
    argv = pinned(layout.load, [WRK, f"-t{layout.threads}", f"-c{connections}",
                                f"-d{seconds}s", "--latency", "-s", str(script),
                                url + "/v1/chat/completions"])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = done.stdout

    def number(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else 0.0

    errors = int(number(r"Non-2xx or 3xx responses: (\d+)"))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors += sum(int(x) for x in sock.groups()) if sock else 0
    return {"rps": number(r"Requests/sec:\s+([\d.]+)"),
            "requests": int(number(r"(\d+) requests in")), "errors": errors,
            "wrk_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime
                               - before.ru_stime, 3)}


def measure(name: str, url: str, proc: subprocess.Popen[bytes] | None,
            backend: subprocess.Popen[bytes], seconds: int, connections: int,
            tmp: Path, layout: Layout = Layout()) -> dict[str, Any]:
    gw0 = cpu_seconds(proc.pid) if proc else 0.0
    be0 = cpu_seconds(backend.pid)
    t0 = time.perf_counter()
    result = wrk(url, seconds, connections, tmp, layout)
    wall = time.perf_counter() - t0
    result["gateway_cpu_ms_per_request"] = round(
        ((cpu_seconds(proc.pid) - gw0) if proc else 0.0) / max(result["requests"], 1) * 1000, 3)
    # wrk and the static backend share the load core: how busy they kept it themselves.
    result["load_core_busy"] = round((cpu_seconds(backend.pid) - be0 + result["wrk_cpu_s"])
                                     / wall / len(expand(layout.load)), 3)
    result["name"] = name
    return result


def label(workers: int) -> str:
    return f"{workers} worker" + ("s" if workers > 1 else "")


def run(rounds: int, seconds: int = 5, connections: int = 64, counts: tuple[int, ...] = (1, 2),
        trimmed: bool = True, layout: Layout = Layout()) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="vgw-scaling-"))
    url, backend = static_backend(tmp, layout)
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], **{label(n): [] for n in counts}}
    try:
        for _ in range(rounds):
            runs["direct"].append(measure("direct", url, None, backend, seconds, connections,
                                          tmp, layout))
            for workers in counts:
                target = targets.gateway([url], tmp, workers=workers,
                                         core=layout.gateway(workers), trimmed=trimmed)
                try:
                    runs[label(workers)].append(measure(label(workers), target.urls[0],
                                                        target.proc, backend, seconds,
                                                        connections, tmp, layout))
                finally:
                    if target.proc:
                        stop(target.proc)
    finally:
        stop(backend)
    config = ("the gateway trimmed (bench.targets.TRIMMED: no Redis, no access log)" if trimmed
              else "the gateway in its default config (embedded Redis, access log)")
    return {"runs": runs, "summary": summarise(runs),
            "setup": (f"{config}; wrk -t{layout.threads} -c{connections} -d{seconds}s and an "
                      f"nginx static backend ({layout.nginx_workers} worker) on cores "
                      f"{layout.load}; " + ", ".join(f"{label(n)} on cores {layout.gateway(n)}"
                                                    for n in counts)
                      + f"; {rounds} interleaved rounds, medians")}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import statistics

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[name]), 3) if runs[name] else 0.0

    out: dict[str, Any] = {name: {"rps": med(name, "rps"),
                                  "gateway_cpu_ms_per_request":
                                      med(name, "gateway_cpu_ms_per_request"),
                                  "load_core_busy": med(name, "load_core_busy"),
                                  "errors": sum(r["errors"] for r in runs[name])}
                           for name in runs}
    names = [n for n in runs if n != "direct"]
    one, last = out[names[0]]["rps"], out[names[-1]]["rps"]
    out["speedup"] = round(last / one, 2) if one else 0.0
    out["speedup_of"] = f"{names[-1]} / {names[0]}"
    return out


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = ["| target | req/s | gateway CPU ms / request | wrk + backend CPU / wall | errors |",
            "|---|---|---|---|---|"]
    for name in result["runs"]:
        r = s[name]
        rows.append(f"| {name} | {r['rps']:.0f} | {r['gateway_cpu_ms_per_request']:.3f} "
                    f"| {r['load_core_busy']:.0%} | {r['errors']} |")
    of = s.get("speedup_of", "2 workers / 1 worker")
    return "\n".join(rows) + f"\n\n{of}: **{s['speedup']:.2f}x** req/s."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--default", action="store_true", help="the default config, not trimmed")
    parser.add_argument("--proxy-cores", default=PROXY_CORE)
    parser.add_argument("--load-cores", default=LOAD_CORE)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--nginx-workers", type=int, default=1)
    args = parser.parse_args()
    if not available():
        print("needs wrk and nginx: run bash bench/install_peers.sh", file=sys.stderr)
        return 2
    layout = Layout(args.proxy_cores, args.load_cores, args.threads, args.nginx_workers)
    result = run(args.rounds, args.seconds, args.connections, tuple(args.workers),
                 not args.default, layout)
    print(result["setup"])
    print(table(result))
    print(json.dumps(result["runs"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
