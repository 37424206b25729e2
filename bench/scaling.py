"""Worker scaling: one gateway worker against two, with a load side too cheap to matter.

On a 2-core machine the Python simulator and load generator saturate their core long
before two gateway workers would (see the comparison's non-stream phase), so this phase
swaps both for C: ``wrk`` sends the requests and an nginx serving a fixed chat completion
plays the backend, together on the load core. One worker runs on the proxy core; two
workers get both cores and share the load core with wrk and nginx (stated in the output).

    .venv/bin/python -m bench.scaling --rounds 3
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


def available() -> bool:
    return shutil.which("wrk") is not None and shutil.which("nginx") is not None


def static_backend(tmp: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """nginx answering /health, /v1/models and every chat completion with one fixed reply."""
    port = free_port()
    prefix = tmp / "static"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
    (prefix / "nginx.conf").write_text(f"""
worker_processes 1;
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
    proc = start(LOAD_CORE, ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                             "-g", "daemon off;"], tmp / "static.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return url, proc


def wrk(url: str, seconds: int, connections: int, tmp: Path) -> dict[str, Any]:
    script = tmp / "post.lua"
    script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\n'
                      'wrk.headers["Content-Type"] = "application/json"\n')
    argv = pinned(LOAD_CORE, ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
                              "-s", str(script), url + "/v1/chat/completions"])
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
            tmp: Path) -> dict[str, Any]:
    gw0 = cpu_seconds(proc.pid) if proc else 0.0
    be0 = cpu_seconds(backend.pid)
    t0 = time.perf_counter()
    result = wrk(url, seconds, connections, tmp)
    wall = time.perf_counter() - t0
    result["gateway_cpu_ms_per_request"] = round(
        ((cpu_seconds(proc.pid) - gw0) if proc else 0.0) / max(result["requests"], 1) * 1000, 3)
    # wrk and the static backend share the load core: how busy they kept it themselves.
    result["load_core_busy"] = round((cpu_seconds(backend.pid) - be0 + result["wrk_cpu_s"])
                                     / wall, 3)
    result["name"] = name
    return result


def run(rounds: int, seconds: int = 5, connections: int = 64) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="vgw-scaling-"))
    url, backend = static_backend(tmp)
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "1 worker": [], "2 workers": []}
    try:
        for _ in range(rounds):
            runs["direct"].append(measure("direct", url, None, backend, seconds, connections,
                                          tmp))
            for workers, name in ((1, "1 worker"), (2, "2 workers")):
                core = PROXY_CORE if workers == 1 else f"{PROXY_CORE},{LOAD_CORE}"
                target = targets.gateway([url], tmp, workers=workers, core=core)
                try:
                    runs[name].append(measure(name, target.urls[0], target.proc, backend,
                                              seconds, connections, tmp))
                finally:
                    if target.proc:
                        stop(target.proc)
    finally:
        stop(backend)
    return {"runs": runs, "summary": summarise(runs),
            "setup": ("the gateway trimmed (bench.targets.TRIMMED: no Redis, no access log); "
                      f"wrk -t1 -c{connections} -d{seconds}s and an nginx static backend on "
                      f"core {LOAD_CORE}; 1 worker on core {PROXY_CORE}, 2 workers on cores "
                      f"{PROXY_CORE},{LOAD_CORE}; {rounds} interleaved rounds, medians")}


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
    one = out["1 worker"]["rps"]
    out["speedup"] = round(out["2 workers"]["rps"] / one, 2) if one else 0.0
    return out


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = ["| target | req/s | gateway CPU ms / request | wrk + backend CPU / wall | errors |",
            "|---|---|---|---|---|"]
    for name in ("direct", "1 worker", "2 workers"):
        r = s[name]
        rows.append(f"| {name} | {r['rps']:.0f} | {r['gateway_cpu_ms_per_request']:.3f} "
                    f"| {r['load_core_busy']:.0%} | {r['errors']} |")
    return "\n".join(rows) + f"\n\n2 workers / 1 worker: **{s['speedup']:.2f}x** req/s."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()
    if not available():
        print("needs wrk and nginx: run bash bench/install_peers.sh", file=sys.stderr)
        return 2
    result = run(args.rounds, args.seconds, args.connections)
    print(result["setup"])
    print(table(result))
    print(json.dumps(result["runs"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
