"""``python -m bench.chaos --minutes 10`` (the report in docs/RELIABILITY.md) or
``--seconds 60 --ci`` (exit 1 on any silent truncation, hang, duplicate or reordered token,
unexplained session move, or request asked of more backends than the budget)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.chaos import stack as stacks
from bench.chaos.clients import Load
from bench.chaos.faults import Driver
from bench.chaos.report import markdown
from bench.chaos.verdict import failures, summarize


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=0)
    length.add_argument("--seconds", type=float, default=0)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="simulators only")
    parser.add_argument("--ci", action="store_true", help="exit 1 on any failing count")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--raw", type=Path, help="write every record and fault as JSON here")
    parser.add_argument("--keep", type=Path, help="keep the logs in this directory")
    args = parser.parse_args()
    seconds = args.seconds or args.minutes * 60 or 60.0
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="chaos-"))
    print(f"chaos: seed {args.seed}, {seconds:g} s, {args.clients} clients, logs in {tmp}",
          flush=True)
    stack = stacks.start(tmp, with_vllm=not args.no_vllm)
    try:
        summary, raw = soak(stack, seconds, args, tmp)
    finally:
        stack.stop()
    command = " ".join(["python -m bench.chaos", *sys.argv[1:]])
    if args.report:
        args.report.write_text(markdown(summary, args.seed, seconds, command))
    if args.raw:
        args.raw.write_text(json.dumps(raw, indent=1))
    print(json.dumps(summary, indent=1, default=str))
    bad = failures(summary)
    if bad:
        print("chaos: FAILED: " + ", ".join(bad), flush=True)
    return 1 if bad and args.ci else 0


def soak(stack: stacks.Stack, seconds: float, args: argparse.Namespace,
         tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    began, began_wall = time.monotonic(), time.time()
    until = began + seconds
    short = seconds < 300
    window = 300.0 if not short else seconds / 2  # the stretch memory is measured over
    driver = Driver(stack, args.seed, until, gap=(1.0, 3.0) if short else (2.0, 8.0),
                    hold=(2.0, 4.0) if short else (2.0, 8.0), spare_from=until - window)
    load = Load([g.ready.rsplit("/", 1)[0] for g in stack.gateways], args.clients, until,
                args.seed, vllm=stack.vllm is not None)
    driver.start()
    asyncio.run(load.run())  # every client ends by itself: no new request after `until`
    driver.join(300)
    if driver.error is not None:
        raise RuntimeError("the chaos driver failed") from driver.error
    driver.sample()
    for rec in load.records:  # seconds since the start, for the report
        rec.start, rec.end = rec.start - began, rec.end - began
    for fault in driver.faults:
        fault.start, fault.end = fault.start - began, fault.end - began
    for sample in driver.samples:
        sample.at, sample.started = sample.at - began, sample.started - began
    summary = summarize(load.records, driver.faults, driver.samples,
                        [g.log for g in stack.gateways], window, began_wall,
                        processes=_serving_processes(stack))
    raw = {"seed": args.seed, "seconds": seconds, "faults": [asdict(f) for f in driver.faults],
           "records": [asdict(r) for r in load.records],
           "samples": [asdict(s) for s in driver.samples]}
    return summary, raw


def _serving_processes(stack: stacks.Stack) -> int:
    """Serving processes over every start of every replica (each starts with a full budget
    floor), from the line each start logs."""
    found = [int(n) for g in stack.gateways
             for n in re.findall(r"with (\d+) worker processes", g.log.read_text(errors="replace"))]
    return max(1, sum(found))


if __name__ == "__main__":
    sys.exit(main())
