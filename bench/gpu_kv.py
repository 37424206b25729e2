"""Issue 38 point 8 on a GPU host: cache-aware routing over four vLLM instances, each with a
small KV cache (about 20k tokens), against the other ways to spread the same requests.

    python -m bench.gpu_kv --instances http://127.0.0.1:8001,http://127.0.0.1:8002,... \
        --arm round_robin=http://127.0.0.1:9001 --arm least_loaded=http://127.0.0.1:9002 \
        --arm prefix=http://127.0.0.1:9003 --arm kv=http://127.0.0.1:9004 \
        --arm cache_aware=http://127.0.0.1:9200 --arm oracle \
        --pid round_robin=123 --pid kv=456 ... --rate 20 --seconds 60 \
        --out runs.jsonl --requests requests.jsonl
    python -m bench.gpu_kv --summary runs.jsonl

The workload (no session keys): ``--prompts`` shared system prompts of about
``--sys-tokens`` tokens each (calibrated with the first instance's /tokenize); each request
is one of them, uniform at random, and a unique user question, a streamed chat completion
of ``--max-tokens`` tokens (ignore_eos), sent at Poisson arrivals of ``--rate`` per second
for ``--seconds``. Each arm (in the order given) gets fresh system prompts of its own seed,
so no arm finds another's prompts cached. ``oracle`` takes no URL: the client sends system
prompt i straight to instance i % N (the routing a gateway could at best reproduce).

Per arm, from the instances' own /metrics before and after: vLLM's prefix-cache hit ratio
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, summed over the
instances) and requests per instance (``vllm:request_success_total``); client side: TTFT
(first content chunk) p50/p90/p99, errors, and the cached share of the prompt tokens that
the replies' ``usage.prompt_tokens_details.cached_tokens`` report; the CPU the proxy's
whole process tree used (``--pid NAME=PID``: utime+stime from /proc) per request. Where
replies carry ``x-gateway-cached-tokens`` (the gateway's ``kv_header``): how many equal
vLLM's cached_tokens (exact), over and under, and the counts of ``x-gateway-kv-rule``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

TICKS = os.sysconf("SC_CLK_TCK")
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
SUCCESS = "vllm:request_success_total"
WAITING = "vllm:num_requests_waiting"
_SYL_ON = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl qu sh st th tr".split()
_SYL_VO = "a e i o u ai ea ie oo ou y".split()
_SYL_CO = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x"]
_lex = random.Random(38)
LEXICON = ["".join(_lex.choice(_SYL_ON) + _lex.choice(_SYL_VO) + _lex.choice(_SYL_CO)
                   for _ in range(_lex.randint(1, 3))) for _ in range(8000)]


def scrape(base: str) -> dict[str, float]:
    """The instance's prefix-cache counters and finished requests (all label sets summed).
    The simulator has no request counter: its /sim/stats request count stands in."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out = {QUERIES: 0.0, HITS: 0.0}
    for line in text.splitlines():
        for name in (QUERIES, HITS, SUCCESS, WAITING):
            if line.startswith((name + "{", name + " ")):
                out[name] = out.get(name, 0.0) + float(line.rsplit(None, 1)[-1])
    if SUCCESS not in out:  # not vLLM
        try:
            stats = json.loads(urllib.request.urlopen(base + "/sim/stats", timeout=10).read())
            out[SUCCESS] = float(stats.get("requests", 0))
        except OSError:
            out[SUCCESS] = 0.0
    return out


def tree_ticks(root: int) -> int:
    """utime + stime of ``root`` and every live descendant, in clock ticks."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(p)] = int(fields[1])
        ticks[int(p)] = int(fields[11]) + int(fields[12])
    family, todo = {root}, [root]
    while todo:
        pid = todo.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in family:
                family.add(child)
                todo.append(child)
    return sum(ticks.get(p, 0) for p in family)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(LEXICON) for _ in range(n))


async def tokens_per_word(session: aiohttp.ClientSession, base: str, model: str) -> float:
    """Calibrate: tokens per lexicon word of a system prompt, by the instance's tokenizer."""
    rng = random.Random(7)
    counts = []
    for n in (100, 600):
        async with session.post(base + "/tokenize", json={
                "model": model, "messages": [{"role": "system", "content": words(rng, n)}],
                "add_generation_prompt": False}) as resp:
            counts.append((await resp.json())["count"])
    return float(counts[1] - counts[0]) / 500


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else float("nan")


async def one(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
              max_tokens: int, keep_text: bool = False) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": False}
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            rec["status"] = resp.status
            for header, key in (("x-gateway-backend", "backend"),
                                ("x-gateway-cached-tokens", "predicted"),
                                ("x-gateway-kv-rule", "rule")):
                if header in resp.headers:
                    rec[key] = resp.headers[header]
            if "predicted" in rec:
                rec["predicted"] = int(rec["predicted"])
            if resp.status != 200:
                rec["error"] = (await resp.text())[:200]
                return rec
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec["error"] = str(data["error"])[:200]
                    return rec
                choices = data.get("choices") or []
                content = choices and (choices[0].get("delta") or {}).get("content")
                if content:
                    chunks += 1
                    if keep_text:
                        text.append(content)
                    if "ttft" not in rec:
                        rec["ttft"] = time.perf_counter() - t0
                usage = data.get("usage")
                if usage:
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    rec["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens")
            rec["chunks"] = chunks
            if keep_text:
                rec["text"] = "".join(text)
            rec["ok"] = "ttft" in rec
            if not rec["ok"]:
                rec["error"] = "no content"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rec["total"] = time.perf_counter() - t0
    return rec


def rate_at(args: argparse.Namespace, t: float) -> float:
    """Requests per second at ``t``: ``--rate``, or rising from it to ``--rate-to``."""
    if args.rate_to is None:
        return float(args.rate)
    return float(args.rate + (args.rate_to - args.rate) * min(1.0, t / args.seconds))


def schedule(rng: random.Random, args: argparse.Namespace) -> list[tuple[float, int, str]]:
    """Arrivals (Poisson, at ``rate_at``): when, which system prompt, the first question.
    With ``--turns`` > 1 each arrival starts a conversation (at a rate ``turns`` times lower,
    so that requests keep coming at about the rate asked)."""
    arrivals: list[tuple[float, int, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_at(args, t) / args.turns)
        if t >= args.seconds:
            return arrivals
        arrivals.append((t, rng.randrange(args.prompts), words(rng, args.question_words)))


async def sample_queue(instances: list[str], into: list[float]) -> None:
    """vLLM's waiting requests, summed over the instances, once a second until cancelled."""
    while True:
        now = await asyncio.gather(*(asyncio.to_thread(scrape, b) for b in instances))
        into.append(sum(m.get(WAITING, 0.0) for m in now))
        await asyncio.sleep(1.0)


async def arm(session: aiohttp.ClientSession, name: str, url: str | None, seed: int,
              args: argparse.Namespace, instances: list[str], sys_words: int,
              pid: int | None, log: str | None) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [words(rng, sys_words) + f" [{seed}-{i}]" for i in range(args.prompts)]
    arrivals = schedule(rng, args)
    thinks = [[rng.expovariate(1 / args.think) for _ in range(args.turns)] for _ in arrivals]
    later = [[words(rng, args.question_words) for _ in range(args.turns)] for _ in arrivals]

    before = await asyncio.gather(*(asyncio.to_thread(scrape, b) for b in instances))
    cpu0 = tree_ticks(pid) if pid else 0
    queue: list[float] = []
    sampler = asyncio.create_task(sample_queue(instances, queue))
    t0 = time.perf_counter()

    async def conversation(n: int, at: float, which: int, question: str) -> list[dict[str, Any]]:
        """One system prompt and ``--turns`` questions, each with the history before it."""
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        target = url or instances[which % len(instances)]
        messages = [{"role": "system", "content": prompts[which]}]
        recs = []
        for turn in range(args.turns):
            asked = question if turn == 0 else later[n][turn]
            messages.append({"role": "user", "content": f"Question {seed}-{n}-{turn}: {asked}?"})
            sent = time.perf_counter() - t0
            rec = await one(session, target, args.model, messages, args.max_tokens,
                            keep_text=turn + 1 < args.turns)
            rec |= {"arm": name, "seed": seed, "n": n, "turn": turn, "at": round(sent, 3),
                    "rate": round(rate_at(args, sent), 1), "prompt": which}
            if url is None:
                rec["backend"] = target
            recs.append(rec)
            if not rec["ok"] or turn + 1 == args.turns:
                break
            messages.append({"role": "assistant", "content": rec.pop("text")})
            await asyncio.sleep(thinks[n][turn])
        return recs

    done = await asyncio.gather(*(conversation(n, *a) for n, a in enumerate(arrivals)))
    recs = [r for c in done for r in c]
    wall = time.perf_counter() - t0
    cpu1 = tree_ticks(pid) if pid else 0
    sampler.cancel()
    await asyncio.sleep(args.settle)  # vLLM's counters are published after the step
    after = await asyncio.gather(*(asyncio.to_thread(scrape, b) for b in instances))
    if log:
        await asyncio.to_thread(_append, log, "".join(json.dumps(r) + "\n" for r in recs))

    ok = [r for r in recs if r["ok"]]
    queries = sum(a[QUERIES] - b[QUERIES] for a, b in zip(after, before, strict=True))
    hits = sum(a[HITS] - b[HITS] for a, b in zip(after, before, strict=True))
    per_instance = [int(a[SUCCESS] - b[SUCCESS]) for a, b in zip(after, before, strict=True)]
    ttfts = [r["ttft"] for r in ok]
    prompt_tokens = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached") or 0 for r in ok)
    result: dict[str, Any] = {
        "arm": name, "seed": seed, "requests": len(recs), "errors": len(recs) - len(ok),
        "wall_s": round(wall, 1), "hit_ratio": round(hits / queries, 3) if queries else None,
        "cached_share": round(cached / prompt_tokens, 3) if prompt_tokens else None,
        "prompt_tokens_mean": round(prompt_tokens / len(ok)) if ok else None,
        "ttft_p50_ms": pct(ttfts, .5), "ttft_p90_ms": pct(ttfts, .9),
        "ttft_p99_ms": pct(ttfts, .99), "per_instance": per_instance,
        "cpu_ms_per_req": round((cpu1 - cpu0) / TICKS * 1000 / len(recs), 3)
        if pid and recs else None,
        "queue_mean": round(sum(queue) / len(queue), 1) if queue else None,
        "queue_max": max(queue) if queue else None,
        "error_samples": sorted({r.get("error", "") for r in recs if not r["ok"]})[:3]}
    if args.turns > 1:
        result["turns"] = args.turns
        result["hit_ratio_by_turn"] = by_turn(ok)
    if args.rate_to is not None:
        result["rate"] = [args.rate, args.rate_to]
        result["buckets"] = buckets(ok, args)
    predicted = [r for r in ok if "predicted" in r and r.get("cached") is not None]
    if predicted:
        result["kv_replies"] = len(predicted)
        result["kv_no_header"] = len(ok) - len(predicted)
        result["kv_exact"] = sum(r["predicted"] == r["cached"] for r in predicted)
        result["kv_over"] = sum(r["predicted"] > r["cached"] for r in predicted)
        result["kv_under"] = sum(r["predicted"] < r["cached"] for r in predicted)
        result["kv_rules"] = dict(Counter(r.get("rule", "?") for r in predicted))
    return result


def by_turn(ok: list[dict[str, Any]]) -> dict[int, float]:
    """The cached share of the prompt tokens (usage) at each turn of the conversations."""
    out = {}
    for turn in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == turn and r.get("prompt_tokens")]
        prompt = sum(r["prompt_tokens"] for r in rs)
        out[turn] = round(sum(r.get("cached") or 0 for r in rs) / prompt, 3) if prompt else 0.0
    return out


def buckets(ok: list[dict[str, Any]], args: argparse.Namespace, n: int = 6
            ) -> list[dict[str, Any]]:
    """The rising rate cut in ``n`` spans of time: the rate, prompt tokens per second sent,
    the cached share and TTFT p50/p90 of each (the knee is where p90 leaves the floor)."""
    span, out = args.seconds / n, []
    for k in range(n):
        rs = [r for r in ok if k * span <= r["at"] < (k + 1) * span]
        prompt = sum(r.get("prompt_tokens") or 0 for r in rs)
        out.append({
            "rate": round(rate_at(args, (k + 0.5) * span), 1), "requests": len(rs),
            "input_tok_s": round(prompt / span),
            "cached_share": round(sum(r.get("cached") or 0 for r in rs) / prompt, 3)
            if prompt else None,
            "ttft_p50_ms": pct([r["ttft"] for r in rs], .5),
            "ttft_p90_ms": pct([r["ttft"] for r in rs], .9)})
    return out


async def main_async(args: argparse.Namespace) -> None:
    instances = [u.rstrip("/") for u in args.instances.split(",")]
    targets: list[tuple[str, str | None]] = []
    for spec in args.arm:
        name, _, url = spec.partition("=")
        targets.append((name, url.rstrip("/") or None))
    pids = {name: int(pid) for name, _, pid in (p.partition("=") for p in args.pid)}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        ratio = await tokens_per_word(session, instances[0], args.model)
        sys_words = max(10, round(args.sys_tokens / ratio))
        print(json.dumps({"tokens_per_word": round(ratio, 3), "sys_words": sys_words}),
              flush=True)
        if args.warmup:  # each instance, then each proxy: short unique requests, unmeasured
            rng = random.Random(1)
            for group in (instances, [u for _, u in targets if u]):
                await asyncio.gather(*(one(session, b, args.model, [
                    {"role": "system", "content": words(rng, 200)},
                    {"role": "user", "content": words(rng, 10)}], args.max_tokens)
                    for b in group for _ in range(args.warmup)))
        for k, (name, url) in enumerate(targets):
            result = await arm(session, name, url, args.seed_base + k, args, instances,
                               sys_words, pids.get(name), args.requests)
            print(json.dumps(result), flush=True)
            if args.out:
                await asyncio.to_thread(_append, args.out, json.dumps(result) + "\n")
            if k + 1 < len(targets):
                await asyncio.sleep(args.pause)


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    print("| arm | hit ratio (vLLM) | cached share (usage) | TTFT p50 / p90 / p99 ms | "
          "requests per instance | requests | errors | vLLM queue mean / max | "
          "proxy CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cpu = r.get("cpu_ms_per_req")
        print(f"| {r['arm']} | {r['hit_ratio']} | {r['cached_share']} | {r['ttft_p50_ms']} / "
              f"{r['ttft_p90_ms']} / {r['ttft_p99_ms']} | "
              f"{' / '.join(map(str, r['per_instance']))} | {r['requests']} | {r['errors']} | "
              f"{r.get('queue_mean', '-')} / {r.get('queue_max', '-')} | "
              f"{'-' if cpu is None else cpu} |")
    for r in rows:
        if "hit_ratio_by_turn" in r:
            print(f"\n{r['arm']}: cached share by turn {json.dumps(r['hit_ratio_by_turn'])}")
        if "buckets" in r:
            print(f"\n{r['arm']}, rate {r['rate'][0]} -> {r['rate'][1]}/s: rate | input tok/s | "
                  "cached share | TTFT p50 / p90 ms")
            for b in r["buckets"]:
                print(f"  {b['rate']} | {b['input_tok_s']} | {b['cached_share']} | "
                      f"{b['ttft_p50_ms']} / {b['ttft_p90_ms']}")
    for r in rows:
        if "kv_replies" in r:
            print(f"\n{r['arm']}: x-gateway-cached-tokens == usage cached_tokens on "
                  f"{r['kv_exact']} / {r['kv_replies']} replies (over {r['kv_over']}, under "
                  f"{r['kv_under']}; {r.get('kv_no_header', 0)} ok replies without the header); "
                  f"x-gateway-kv-rule: {json.dumps(r['kv_rules'])}")
        if r.get("error_samples"):
            print(f"{r['arm']} errors, e.g.: {r['error_samples']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", help="comma-separated vLLM base URLs (metrics, oracle)")
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=URL (a proxy), or 'oracle' (system prompt i to instance i %% N)")
    ap.add_argument("--pid", action="append", default=[], help="NAME=PID: the proxy's root")
    ap.add_argument("--model", default="test")
    ap.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    ap.add_argument("--rate-to", type=float, help="the rate rises to this by the arm's end")
    ap.add_argument("--turns", type=int, default=1, help="questions per conversation")
    ap.add_argument("--think", type=float, default=1.0,
                    help="mean seconds between a reply and the next turn")
    ap.add_argument("--seconds", type=float, default=60.0, help="per arm")
    ap.add_argument("--prompts", type=int, default=40, help="shared system prompts per arm")
    ap.add_argument("--sys-tokens", type=int, default=2000)
    ap.add_argument("--question-words", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed-base", type=int, default=3800)
    ap.add_argument("--warmup", type=int, default=4, help="requests per instance first")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between arms")
    ap.add_argument("--settle", type=float, default=1.0, help="before the after-scrape")
    ap.add_argument("--timeout", type=float, default=60.0, help="per request")
    ap.add_argument("--out", help="append one JSON line per arm")
    ap.add_argument("--requests", help="append one JSON line per request")
    ap.add_argument("--summary", help="print the table of an --out file and stop")
    args = ap.parse_args()
    if args.summary:
        summary(args.summary)
        return
    if not args.instances or not args.arm:
        ap.error("--instances and --arm are needed")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
