"""SIGKILL one real vLLM instance under sticky load through the gateway (issue 9, point 3).

Runs conversations through the gateway for ``--seconds``; after ``--kill-after`` seconds
sends SIGKILL to the vLLM server process of one spawned backend (the child of its reaper),
then reports what clients saw, how long the supervisor took to have it ready again, and
how many sessions were re-pinned.

    python -m bench.gpu_kill --gateway URL --backend vllm-1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.gpu_sticky import WORDS, turn


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


async def status(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(url + "/admin/status") as r:
        data = await r.json()
    found: dict[str, Any] = next(b for b in data["backends"] if b["name"] == name)
    return found


async def sticky_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_sticky_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--backend", default="vllm-1")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--kill-after", type=float, default=10)
    ap.add_argument("--conc", type=int, default=32)
    args = ap.parse_args()
    url, rng = args.gateway, random.Random(7)
    outcomes: list[tuple[float, bool]] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await sticky_counts(session, url)

        async def conversation(i: int) -> None:
            messages = [{"role": "system", "content": " ".join(rng.choice(WORDS)
                                                               for _ in range(800))}]
            while time.monotonic() - t0 < args.seconds:
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS)
                                                                    for _ in range(30))})
                try:
                    ttft, text, _ = await turn(session, url, messages,
                                               {"x-session-id": f"kill-{i}"})
                except aiohttp.ClientError:
                    ttft, text = None, ""
                outcomes.append((time.monotonic() - t0, ttft is not None))
                messages = messages[:1] + messages[-6:] + [{"role": "assistant",
                                                            "content": text}]

        load = [asyncio.create_task(conversation(i)) for i in range(args.conc)]
        await asyncio.sleep(args.kill_after)
        info = await status(session, url, args.backend)
        victims = children(info["pid"])
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic() - t0
        ready_at = None
        while time.monotonic() - t0 < args.seconds:
            await asyncio.sleep(0.5)
            info = await status(session, url, args.backend)
            if info["state"] == "ready" and info["restarts"] >= 1:
                ready_at = time.monotonic() - t0
                break
        await asyncio.gather(*load)
        after = await sticky_counts(session, url)
    failed = [t for t, ok in outcomes if not ok]
    print(json.dumps({
        "killed_pids": victims, "killed_at_s": round(killed_at, 1),
        "ready_again_after_s": round(ready_at - killed_at, 1) if ready_at else None,
        "requests": len(outcomes), "failed": len(failed),
        "failed_window_s": [round(min(failed), 1), round(max(failed), 1)] if failed else None,
        "sticky_delta": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
