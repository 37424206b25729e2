"""How long an operator's canary change takes to reach another gateway replica (issue 7:
within a second). Two gateways share one valkey; each change is made on the first and
the second is polled every 5 ms until it applies it.

    .venv/bin/python -m bench.canary_propagation [--changes 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import LOAD_CORE, PROXY_CORE, free_port, start, stop, wait_http
from gateway.state.embedded import valkey_binary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=30)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-canary-"))
    redis_port = free_port()
    redis = subprocess.Popen([str(valkey_binary()), "--port", str(redis_port), "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    sims = [free_port(), free_port()]
    procs = [start(LOAD_CORE, [sys.executable, "-m", "gateway", "sim", "--port", str(p)],
                   tmp / f"sim{p}.log") for p in sims]
    gws = [free_port(), free_port()]
    for port in gws:
        cfg = tmp / f"gw{port}.toml"
        cfg.write_text(
            f'[gateway]\nlisten = "127.0.0.1:{port}"\nlog_level = "warning"\n'
            f'[redis]\nurl = "redis://127.0.0.1:{redis_port}/0"\n[canary]\nenabled = true\n'
            f'\n[[backends]]\nname = "s"\nurl = "http://127.0.0.1:{sims[0]}"\n'
            f'\n[[backends]]\nname = "c"\nurl = "http://127.0.0.1:{sims[1]}"\ngroup = "canary"\n')
        procs.append(start(PROXY_CORE, [sys.executable, "-m", "gateway", "serve", "--config",
                                        str(cfg)], tmp / f"gw{port}.log"))
    try:
        for port in gws:
            wait_http(f"http://127.0.0.1:{port}/readyz")
        one, two = (f"http://127.0.0.1:{p}" for p in gws)
        delays = []
        with httpx.Client(timeout=5) as client:
            for i in range(args.changes):
                weight = float((i % 2) * 10 + i)  # always a new value
                t0 = time.perf_counter()
                client.post(one + "/admin/canary/set", json={"group": "canary",
                                                             "weight": weight, "why": "bench"})
                while client.get(two + "/admin/canary").json()["state"]["weight"] != weight:
                    time.sleep(0.005)
                delays.append((time.perf_counter() - t0) * 1000)
        q = statistics.quantiles(delays, n=20)
        print(f"{args.changes} changes made on one replica, applied by the other after: "
              f"p50 {statistics.median(delays):.0f} ms, p95 {q[18]:.0f} ms, "
              f"max {max(delays):.0f} ms (canary.sync_interval = 0.25 s)")
    finally:
        for proc in procs:
            stop(proc)
        redis.kill()


if __name__ == "__main__":
    main()
