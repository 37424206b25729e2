"""Issue 40 point 5: what a SIGKILL of the gateway mid-batch costs the batch.

A simulator (TTFT ``--ttft``), the gateway in its default config (a worker per core,
embedded Redis) with a batch of ``--lines`` lines; once ``--kill-after`` results are
written, the gateway's whole process group is SIGKILLed and started again on the same data
and batch directories. Measured: seconds from the kill to the gateway's readiness, to the
first new result (the time the batch lost: the lease the dead process held lapses first,
up to 5 s), and to the batch's end; the requests after the restart (the lines without a
result: those in flight at the kill are sent again); and that every custom_id is in the
output once.

    python -m bench.batch_resume --lines 2000 --kill-after 500
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import orjson

from bench.common import free_port, metric, start, stop, wait_http


def lines(n: int) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": 4,
                 "messages": [{"role": "user", "content": f"line {i}"}]}}) + b"\n"
        for i in range(n))


def written(out: Path) -> int:
    return len(out.read_bytes().splitlines()) if out.exists() else 0


def run(work: Path, n: int, kill_after: int, ttft: float) -> dict[str, object]:
    sim_port, port = free_port(), free_port()
    sim = start(None, [sys.executable, "-m", "gateway", "sim", "--port", str(sim_port),
                       "--ttft", str(ttft)], work / "sim.log")
    url = f"http://127.0.0.1:{port}"
    config = work / "gw.toml"
    config.write_text(f'[gateway]\nlisten = "127.0.0.1:{port}"\n[redis]\ndata_dir = '
                      f'"{work}/valkey"\n[[backends]]\nname = "s"\n'
                      f'url = "http://127.0.0.1:{sim_port}"\n')
    argv = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    gw = start(None, argv, work / "gw1.log")
    try:
        wait_http(url + "/readyz", 60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        source = client.files.create(file=("in.jsonl", io.BytesIO(lines(n))), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        out = work / "batch" / f"{batch.id}.output.jsonl"
        began = time.monotonic()
        while written(out) < kill_after:
            time.sleep(0.01)
        rate = written(out) / (time.monotonic() - began)
        os.killpg(gw.pid, signal.SIGKILL)
        killed, before = time.monotonic(), written(out)
        gw.wait(10)
        gw = start(None, argv, work / "gw2.log")
        wait_http(url + "/readyz", 60)
        ready = time.monotonic() - killed
        while written(out) <= before:
            time.sleep(0.01)
        resumed = time.monotonic() - killed
        while client.batches.retrieve(batch.id).status != "completed":
            time.sleep(0.1)
        ended = time.monotonic() - killed
        ids = [orjson.loads(line)["custom_id"] for line in out.read_bytes().splitlines()]
        return {"lines": n, "killed_after": before, "lines_per_s_before": round(rate, 1),
                "ready_s": round(ready, 2), "first_new_result_s": round(resumed, 2),
                "ended_s": round(ended, 2),
                "sent_after_restart": int(metric(url, "gateway_requests_total")),
                "each_once": sorted(ids) == sorted(f"l{i}" for i in range(n))}
    finally:
        stop(gw)
        stop(sim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--kill-after", type=int, default=500)
    parser.add_argument("--ttft", type=float, default=0.02)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-resume-") as tmp:
        result = run(Path(tmp), args.lines, args.kill_after, args.ttft)
    result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
