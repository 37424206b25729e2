"""SIGKILL one real vLLM instance under sticky load through the gateway (issue 9, point 3;
issue 25, point 7: with stream continuation on).

Runs conversations through the gateway for ``--seconds``; after ``--kill-after`` seconds
sends SIGKILL to the vLLM server process of one spawned backend (the child of its reaper),
then reports what clients saw, how long the supervisor took to have it ready again, and
how many sessions were re-pinned.

Every request is a temperature-0 chat stream (``--temperature``/``--seed`` to change it), so
the gateway's ``[resilience] continue_streams = "deterministic"`` (its default) applies. The
streams that were on the killed instance at the kill are the ones whose
``x-gateway-backend`` header (the backend that started them) names it and that were open at
the kill: for each, whether it ended with ``[DONE]`` and no error event, and the seam (the
largest gap between two consecutive data events, which should be the one around the kill).
With ``--direct-port``, each such stream's request is replayed afterwards, non-streaming, to
that vLLM instance directly (no reply cache), and the texts are compared.

    python -m bench.gpu_kill --gateway URL --backend vllm-1 [--direct-port 8001]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.gpu_sticky import WORDS

COUNTERS = ("gateway_sticky_total", "gateway_stream_continuations_total",
            "gateway_stream_failures_total", "gateway_retries_total")


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


async def counters(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    """The labelled counters of COUNTERS, by their first label's value."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in out and '"' in line:
            label = line.split('"')[1]
            out[name][label] = out[name].get(label, 0.0) + float(line.split()[-1])
    return out


@dataclass
class Stream:
    conv: int
    start: float
    messages: list[dict[str, str]]
    end: float = 0.0
    backend: str | None = None
    request_id: str | None = None
    status: int | None = None
    times: list[float] = field(default_factory=list)  # each data event, [DONE] included
    text: str = ""
    done: bool = False  # [DONE] arrived
    error: str | None = None  # an error event's message, or the client's exception


async def turn(session: aiohttp.ClientSession, url: str, s: Stream, headers: dict[str, str],
               extra: dict[str, Any]) -> None:
    pieces: list[str] = []
    try:
        async with session.post(url + "/v1/chat/completions", headers=headers, json={
                "model": "test", "messages": s.messages, "max_tokens": 32, "stream": True,
                **extra}) as resp:
            s.status = resp.status
            s.backend = resp.headers.get("x-gateway-backend")
            s.request_id = resp.headers.get("x-request-id")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                s.times.append(time.monotonic())
                if b"[DONE]" in line:
                    s.done = True
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    err = data["error"]
                    s.error = err.get("message") if isinstance(err, dict) else str(err)
                    continue
                choices = data.get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if content:
                    pieces.append(content)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        s.error = s.error or f"{type(exc).__name__}: {exc}"
    s.end = time.monotonic()
    s.text = "".join(pieces)


def ok(s: Stream) -> bool:
    return s.status == 200 and s.done and s.error is None


def gaps(s: Stream) -> list[float]:
    return [b - a for a, b in zip(s.times, s.times[1:], strict=False)]


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None


async def replay(session: aiohttp.ClientSession, port: int, s: Stream,
                 extra: dict[str, Any]) -> str | None:
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                "model": "test", "messages": s.messages, "max_tokens": 32, **extra}) as r:
            body = await r.json()
        content: str = body["choices"][0]["message"]["content"] or ""
        return content
    except (aiohttp.ClientError, KeyError, ValueError, IndexError):
        return None


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--backend", default="vllm-1")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--kill-after", type=float, default=10)
    ap.add_argument("--conc", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="a fixed seed per request")
    ap.add_argument("--direct-port", type=int, default=None,
                    help="replay the killed instance's streams here to compare texts")
    args = ap.parse_args()
    url, rng = args.gateway, random.Random(7)
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.seed is not None:
        extra["seed"] = args.seed
    streams: list[Stream] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await counters(session, url)

        async def conversation(i: int) -> None:
            messages = [{"role": "system", "content": " ".join(rng.choice(WORDS)
                                                               for _ in range(800))}]
            while time.monotonic() - t0 < args.seconds:
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS)
                                                                    for _ in range(30))})
                s = Stream(i, time.monotonic(), messages)
                streams.append(s)
                await turn(session, url, s, {"x-session-id": f"kill-{i}"}, extra)
                messages = messages[:1] + messages[-6:] + [{"role": "assistant",
                                                            "content": s.text}]

        load = [asyncio.create_task(conversation(i)) for i in range(args.conc)]
        await asyncio.sleep(args.kill_after)
        info = await status(session, url, args.backend)
        victims = children(info["pid"])
        kill = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        ready_at = None
        while time.monotonic() - t0 < args.seconds:
            await asyncio.sleep(0.5)
            info = await status(session, url, args.backend)
            if info["state"] == "ready" and info["restarts"] >= 1:
                ready_at = time.monotonic()
                break
        await asyncio.gather(*load)
        after = await counters(session, url)

        hit = [s for s in streams if s.backend == args.backend and s.start < kill < s.end]
        others = [s for s in streams if s.backend != args.backend and s.start < kill < s.end]
        replays: list[str | None] = []
        if args.direct_port is not None:
            replays = [await replay(session, args.direct_port, s, extra) for s in hit]

    rel = lambda t: round(t - kill, 4)  # noqa: E731 seconds from the kill
    detail = []
    seams: list[float] = []
    for k, s in enumerate(hit):
        g = gaps(s)
        j = max(range(len(g)), key=g.__getitem__) if g else None
        before_kill = [t for t in s.times if t <= kill]
        after_kill = [t for t in s.times if t > kill]
        if ok(s) and j is not None:
            seams.append(g[j])
        row: dict[str, Any] = {
            "conv": s.conv, "request_id": s.request_id, "status": s.status,
            "completed": ok(s), "done": s.done, "error": s.error,
            "started_s": rel(s.start), "ended_s": rel(s.end), "events": len(s.times),
            "events_before_kill": len(before_kill), "chars": len(s.text),
            "seam_ms": round(g[j] * 1000, 1) if j is not None else None,
            "seam_after_event": j + 1 if j is not None else None,
            "seam_from_s": rel(s.times[j]) if j is not None else None,
            "seam_to_s": rel(s.times[j + 1]) if j is not None else None,
            "gap_across_kill_ms": round((after_kill[0] - before_kill[-1]) * 1000, 1)
            if before_kill and after_kill else None,
            "median_other_gap_ms": round(statistics.median(
                [x for i, x in enumerate(g) if i != j]) * 1000, 1) if len(g) > 1 else None,
            "text": s.text}
        if replays:
            row["replay_text"] = replays[k]
            row["text_equals_replay"] = replays[k] == s.text
        detail.append(row)
    other_gaps = [max(gaps(s)) for s in others if ok(s) and len(s.times) > 1]
    failed = [s for s in streams if not ok(s)]
    delta = {name: {k: after[name].get(k, 0) - before[name].get(k, 0)
                    for k in after[name] if after[name].get(k, 0) != before[name].get(k, 0)}
             for name in COUNTERS}
    print(json.dumps({
        "killed_pids": victims, "killed_at_s": round(kill - t0, 1),
        "ready_again_after_s": round(ready_at - kill, 1) if ready_at else None,
        "sampling": extra,
        "requests": len(streams), "failed": len(failed),
        "failed_window_s": [round(min(s.start for s in failed) - kill, 1),
                            round(max(s.end for s in failed) - kill, 1)] if failed else None,
        "failed_by_backend": {b: sum(s.backend == b for s in failed)
                              for b in sorted({str(s.backend) for s in failed})},
        "on_killed_at_kill": len(hit),
        "on_killed_completed": sum(ok(s) for s in hit),
        "on_killed_error": sum(s.error is not None for s in hit),
        "on_killed_no_done": sum(not s.done for s in hit),
        "seam_ms": {"n": len(seams), "p50": pct(seams, .5), "max": pct(seams, 1.0),
                    "min": pct(seams, 0.0)},
        "other_streams_open_at_kill": len(others),
        "other_streams_max_gap_ms": {"n": len(other_gaps), "p50": pct(other_gaps, .5),
                                     "max": pct(other_gaps, 1.0)},
        "text_equals_replay": sum(r.get("text_equals_replay", False) for r in detail)
        if replays else None,
        "counters_delta": delta,
        "sticky_delta": delta["gateway_sticky_total"],
        "on_killed": detail,
    }, indent=1), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
