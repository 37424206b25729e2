"""What each rule of the kv policy did, per sixth of an arm (issue 38): from a
``bench/gpu_kv.py`` requests file (one line per request, ``.gz`` or not), the requests each
rule decided, their TTFT p50 and the share of their prompt vLLM found cached; and for every
arm the TTFT p50 of misses (under half cached) and hits. Prints a Markdown table.

    python -m bench.kv_rules docs/gpu/issue38/run3-h100/knee-requests.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from typing import Any


def rows(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}" if values else "-"


def share(group: list[dict[str, Any]]) -> str:
    prompt = sum(r["prompt_tokens"] for r in group)
    return f"{sum(r['cached'] for r in group) / prompt:.2f}" if prompt else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requests")
    parser.add_argument("--parts", type=int, default=6)
    args = parser.parse_args()
    by_arm: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows(args.requests):
        if r.get("ok"):
            by_arm[r["arm"]].append(r)
    print("| arm | part | rate /s | requests | miss TTFT p50 ms | hit TTFT p50 ms "
          "| rule: requests, TTFT p50 ms, cached share |")
    print("|---|---|---|---|---|---|---|")
    for arm, group in by_arm.items():
        end = max(r["at"] for r in group) or 1.0
        for part in range(args.parts):
            these = [r for r in group
                     if part * end / args.parts <= r["at"] < (part + 1) * end / args.parts
                     or (part == args.parts - 1 and r["at"] == end)]
            if not these:
                continue
            misses = [r["ttft"] for r in these if r["cached"] < r["prompt_tokens"] / 2]
            hits = [r["ttft"] for r in these if r["cached"] >= r["prompt_tokens"] / 2]
            rules: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in these:
                if r.get("rule"):
                    rules[r["rule"]].append(r)
            said = "; ".join(f"{rule}: {len(g)}, {ms([r['ttft'] for r in g])}, {share(g)}"
                             for rule, g in sorted(rules.items(), key=lambda kv: -len(kv[1])))
            rate = statistics.mean(r.get("rate", 0) for r in these)
            print(f"| {arm} | {part + 1} | {rate:.0f} | {len(these)} | {ms(misses)} | "
                  f"{ms(hits)} | {said or '-'} |")


if __name__ == "__main__":
    main()
