"""What the request log costs per request: metrics alone, and metrics with the access-log
line, through the gateway's own JSON writer (``JsonLines``, the default) and through the
logging module (the path the text format takes), each written to a file.

    .venv/bin/python -m bench.request_log --requests 50000

In one process, CPU time (``time.process_time``) per ``RequestLog.done`` call, a loop turn
every 8 requests so the JSON writer batches as it does under load; medians of 5 rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway.metrics import Metrics
from gateway.observability import logs
from gateway.observability.access_log import RequestLog
from tests.factories import backend, record


async def per_request(log: RequestLog, requests: int) -> float:
    rec = record(stream=True, model="m")
    rec.served_by, rec.status, rec.first_byte, rec.last_byte, rec.chunks = (
        backend(), 200, 0.1, 1.0, 64)
    began = time.process_time()
    for i in range(requests):
        log.done(rec, 2.0)
        if i % 8 == 7:
            await asyncio.sleep(0)
    return (time.process_time() - began) / requests * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "access.log"
    stream = out.open("w")
    results: dict[str, list[float]] = {"metrics only": [], "metrics + line (JSON writer)": [],
                                       "metrics + line (logging module)": []}
    metrics = Metrics()
    for _ in range(args.rounds):
        for name in results:
            logs.setup("info", fmt="json")
            logging.getLogger().handlers[0].setStream(stream)  # type: ignore[attr-defined]
            log = RequestLog(metrics, access_log=name != "metrics only")
            if "logging module" in name:
                log._checked = True  # the JSON writer left out: every line through logging
            results[name].append(asyncio.run(per_request(log, args.requests)))
    stream.close()
    medians = {k: round(statistics.median(v), 2) for k, v in results.items()}
    print("| path | CPU µs per request |\n|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value} |")
    print(json.dumps({"command": " ".join(sys.argv), "medians_us": medians, "raw_us": results}),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
