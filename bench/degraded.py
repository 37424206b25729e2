"""How fast a degraded reply comes back once no backend can serve (issue 6: within 100 ms).

Starts one simulator and one gateway (panic = "degrade", a static message), caches one
reply, opens the only breaker with three injected 500s, then times N requests of each
kind end to end from the client: cached reply, cached reply replayed as SSE, static
message, and the final 503. Also times the same request served normally, for scale.

    .venv/bin/python -m bench.degraded [--n 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import LOAD_CORE, PROXY_CORE, free_port, start, stop, wait_http

BODY = {"model": "sim-model", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "what is a gateway?"}]}


def timed(client: httpx.Client, n: int, body: dict[str, object], expect: str | None,
          path: str = "/v1/chat/completions") -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        _ = r.content
        out.append((time.perf_counter() - t0) * 1000)
        assert r.headers.get("x-gateway-degraded") == expect, (r.status_code, r.headers)
    return out


def row(name: str, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"| {name} | {statistics.median(ms):.2f} | {q[98]:.2f} | {max(ms):.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-degraded-"))
    sim_port, gw_port = free_port(), free_port()
    sim = start(LOAD_CORE, [sys.executable, "-m", "gateway", "sim", "--port", str(sim_port)],
                tmp / "sim.log")
    cfg = tmp / "gw.toml"
    cfg.write_text(f'[gateway]\nlisten = "127.0.0.1:{gw_port}"\nlog_level = "error"\n'
                   "[routing]\nsticky = false\n"
                   '[breaker]\nfailure_threshold = 3\nreset_timeout = 3600\npanic = "degrade"\n'
                   '[degraded]\nstatic_message = "busy, try again soon"\n'
                   f'[[backends]]\nname = "s0"\nurl = "http://127.0.0.1:{sim_port}"\n')
    gw = start(PROXY_CORE, [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
               tmp / "gw.log")
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        with httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=10) as client:
            normal = timed(client, args.n, BODY, None)
            for _ in range(3):
                client.post("/v1/chat/completions", json={**BODY, "temperature": 1},
                            headers={"x-sim": "fault=500"})
            cached = timed(client, args.n, BODY, "cache")
            streamed = timed(client, args.n, {**BODY, "stream": True}, "cache")
            static = timed(client, args.n, {**BODY, "max_tokens": 3}, "static")
            unavailable = timed(client, args.n, {"model": "sim-model", "input": "x"}, None,
                                "/v1/embeddings")
        print(f"n = {args.n} sequential requests per kind; gateway on core {PROXY_CORE}, "
              f"simulator and client on core {LOAD_CORE}\n")
        print("| reply | p50 ms | p99 ms | max ms |\n| --- | --- | --- | --- |")
        for name, ms in (("normal (backend answers, 8 tokens)", normal),
                         ("degraded: cache", cached), ("degraded: cache as SSE", streamed),
                         ("degraded: static", static), ("no backend, nothing: 503", unavailable)):
            print(row(name, ms))
    finally:
        stop(gw)
        stop(sim)


if __name__ == "__main__":
    main()
