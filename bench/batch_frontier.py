"""Issue 40 point 5: how much of the idle capacity can any scheduler give a batch without
preempting it, on the simulator's capacity model? A discrete-event model of what
``bench/batch_idle.py`` runs, with no gateway in it: ``--slots`` places (two simulators of 8),
each request holding one for ``--hold`` seconds (TTFT 0.1 s + 15 x 0.01 s), interactive
requests arriving as a Poisson stream at ``--share`` of the capacity's throughput, served
first come first served ahead of every batch line (a strict priority, as the gateway's
band), and batch lines started whenever a place is free and no interactive request waits,
under one of two rules:

  cap K       at most K lines in flight (the gateway's ``[batch] concurrency``)
  reserve R   a line starts only while more than R places are free (headroom for the
              next interactive bursts)
  cap K + reserve R   both

A line in flight is never preempted. Per rule: batch lines/s and its share of the idle
capacity, interactive TTFT p50/p99 (the wait for a place + the simulator's 0.1 s), and
their change against no batch. The frontier is the largest share whose p50 and p99 stay
within ``--within`` (10 %) of the run without a batch.

    python -m bench.batch_frontier --seconds 3000 --out bench/results/batch_frontier.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from pathlib import Path

from bench.loadgen import percentiles

TTFT = 0.1


def run(slots: int, hold: float, rate: float, seconds: float, cap: int, reserve: int,
        seed: int) -> dict[str, float]:
    """One run; ``cap`` 0: no batch."""
    rng = random.Random(seed)
    ends: list[tuple[float, bool]] = []  # (time a place frees, held by a batch line)
    waiting: list[float] = []  # interactive arrivals waiting, oldest first
    ttfts: list[float] = []
    batch_done = 0
    in_batch = 0
    now, next_arrival = 0.0, rng.expovariate(rate)

    def fill(t: float) -> None:
        nonlocal in_batch
        while waiting and len(ends) < slots:  # interactive first, oldest first
            arrived = waiting.pop(0)
            ttfts.append(t - arrived + TTFT)
            heapq.heappush(ends, (t + hold, False))
        while (cap and not waiting and in_batch < cap and slots - len(ends) > reserve):
            heapq.heappush(ends, (t + hold, True))
            in_batch += 1

    fill(0.0)
    while now < seconds:
        if ends and ends[0][0] <= next_arrival:
            now, was_batch = heapq.heappop(ends)
            if was_batch:
                in_batch -= 1
                batch_done += 1
        else:
            now = next_arrival
            waiting.append(now)
            next_arrival = now + rng.expovariate(rate)
        fill(now)
    p = percentiles(ttfts)  # seconds in, milliseconds out
    return {"n": len(ttfts), "p50_ms": round(p["p50"], 1), "p99_ms": round(p["p99"], 1),
            "batch_per_s": round(batch_done / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--hold", type=float, default=0.25)
    parser.add_argument("--share", type=float, default=0.7)
    parser.add_argument("--seconds", type=float, default=3000)
    parser.add_argument("--within", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    capacity = args.slots / args.hold
    rate = args.share * capacity
    idle = capacity - rate
    common = (args.slots, args.hold, rate, args.seconds)
    alone = run(*common, cap=0, reserve=0, seed=args.seed)
    rules = [("cap", k, run(*common, cap=k, reserve=0, seed=args.seed))
             for k in (1, 2, 3, 4, 6, 8, 12, 16)]
    rules += [("reserve", r, run(*common, cap=args.slots, reserve=r, seed=args.seed))
              for r in (0, 1, 2, 3, 4, 6, 8)]
    rules += [(f"cap {k} + reserve", r, run(*common, cap=k, reserve=r, seed=args.seed))
              for k in (2, 3, 4, 6, 8) for r in (1, 2, 3)]
    rows = []
    for rule, k, got in rules:
        share = got["batch_per_s"] / idle
        rows.append({"rule": f"{rule} {k}", **got, "share_of_idle": round(share, 3),
                     "p50_change": round(got["p50_ms"] / alone["p50_ms"] - 1, 3),
                     "p99_change": round(got["p99_ms"] / alone["p99_ms"] - 1, 3)})
    ok = [r for r in rows if r["p50_change"] <= args.within and r["p99_change"] <= args.within]
    frontier = max(ok, key=lambda r: r["share_of_idle"]) if ok else None
    print(f"capacity {capacity:.1f}/s, interactive {rate:.1f}/s, idle {idle:.1f}/s; "
          f"alone: p50 {alone['p50_ms']} ms, p99 {alone['p99_ms']} ms")
    print("| rule | batch lines/s | share of idle | TTFT p50 ms (change) | p99 ms (change) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['rule']} | {r['batch_per_s']} | {r['share_of_idle']} | {r['p50_ms']} "
              f"({r['p50_change']:+.0%}) | {r['p99_ms']} ({r['p99_change']:+.0%}) |")
    print("frontier (p50 and p99 within "
          f"{args.within:.0%}): {frontier['rule'] if frontier else 'none'}"
          + (f", share {frontier['share_of_idle']}" if frontier else ""))
    if args.out:
        args.out.write_text(json.dumps({**vars(args), "out": None, "alone": alone, "rows": rows,
                                        "frontier": frontier}, indent=1) + "\n")


if __name__ == "__main__":
    main()
