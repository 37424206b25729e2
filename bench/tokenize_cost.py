"""Issue 38 point 3: what it costs to know a request's token ids, for chat prompts of about
1k, 4k and 16k tokens, by each mechanism the gateway could use:

- ``/tokenize`` on a vLLM instance (what the ``kv`` policy does): the instance's CPU (its
  whole process tree, from /proc) and the round trip, per request;
- the gateway's own share: reading the reply and hashing the blocks (``gateway.kv.index.
  keys``, 16-token blocks) and matching them against an index that holds them;
- a local tokenizer in the gateway (``transformers``' ``apply_chat_template``, the same
  template and tokenizer files vLLM serves with), when importable: its CPU per request,
  and whether its ids equal vLLM's.

And a conversation of ``--turns`` turns growing to the largest size: the CPU of tokenizing
its whole history every turn, against tokenizing only what each turn adds, and (in the
gateway's venv) against the kv policy's memory of turns (``gateway.request.turns``).

    python -m bench.tokenize_cost --url http://127.0.0.1:8300 --model tiny \\
        --pid PID --local models/tiny-llama --out bench/results/issue38_tokenize_cost.json

Run it with an interpreter that has ``transformers`` (vLLM's venv) for the local column.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
import urllib.request
from typing import Any

from gateway.kv.index import Index, keys

try:  # the gateway reads replies with orjson; vLLM's venv may not have it
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

SIZES = (1_000, 4_000, 16_000)
WORDS = "the river flows past the old mill and down to the sea where boats wait".split()


def ticks(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it (utime + stime)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            continue
    return total


def post(url: str, body: dict[str, Any]) -> tuple[bytes, float]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        raw = reply.read()
    return raw, time.perf_counter() - start


def chat(words: int, seed: int) -> list[dict[str, str]]:
    text = " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{(i + seed) % 97}" for i in range(words))
    return [{"role": "system", "content": text}, {"role": "user", "content": f"Question {seed}?"}]


def sized(url: str, model: str, target: int) -> int:
    """Words of ``chat`` that make about ``target`` tokens."""
    raw, _ = post(url + "/tokenize", {"model": model, "messages": chat(100, 0)})
    per_word = json.loads(raw)["count"] / 100
    return max(1, int(target / per_word))


def remote(url: str, model: str, words: int, pid: int, n: int) -> dict[str, Any]:
    walls, cpu0, counts, gateway_cpu = [], ticks(pid), [], 0.0
    index = Index()
    for i in range(n):
        raw, wall = post(url + "/tokenize", {"model": model, "messages": chat(words, i)})
        walls.append(wall)
        start = time.process_time()
        tokens = loads(raw)["tokens"]
        blocks = keys(tokens[:-1], 16)
        index.guess("a", blocks)
        index.match(blocks)
        gateway_cpu += time.process_time() - start
        counts.append(len(tokens))
    return {"tokens": int(statistics.mean(counts)), "n": n,
            "vllm_cpu_ms": round((ticks(pid) - cpu0) / n * 1000, 3),
            "wall_p50_ms": round(statistics.median(walls) * 1000, 2),
            "wall_p99_ms": round(sorted(walls)[int(0.99 * (n - 1))] * 1000, 2),
            "gateway_cpu_ms": round(gateway_cpu / n * 1000, 3)}


def local(path: str, url: str, model: str, words: int, n: int) -> dict[str, Any]:
    from transformers import AutoTokenizer  # only where vLLM's venv runs this

    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.process_time()
    for i in range(n):
        ids = tokenizer.apply_chat_template(chat(words, i), tokenize=True,
                                            add_generation_prompt=True)
    cpu = (time.process_time() - start) / n
    if hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    raw, _ = post(url + "/tokenize", {"model": model, "messages": chat(words, n - 1)})
    equal = list(ids) == json.loads(raw)["tokens"]
    return {"local_cpu_ms": round(cpu * 1000, 3), "local_equal": equal}


def conversation(url: str, model: str, words: int, pid: int, turns: int) -> dict[str, Any]:
    """A conversation whose history grows to about ``words`` words over ``turns`` turns:
    vLLM's CPU for tokenizing the whole history every turn, and for only each new turn."""
    step = max(1, words // turns)
    messages: list[dict[str, str]] = []
    whole = 0.0
    cpu0 = ticks(pid)
    for t in range(turns):
        messages += [{"role": "user", "content": " ".join(WORDS[(t + i) % len(WORDS)]
                                                           for i in range(step))},
                     {"role": "assistant", "content": f"Answer {t}."}]
        post(url + "/tokenize", {"model": model, "messages": messages})
    whole = ticks(pid) - cpu0
    cpu0 = ticks(pid)
    for t in range(turns):
        post(url + "/tokenize", {"model": model, "messages": messages[2 * t:2 * t + 2]})
    added = ticks(pid) - cpu0
    return {"turns": turns, "whole_history_cpu_ms": round(whole * 1000, 1),
            "new_turn_only_cpu_ms": round(added * 1000, 1)}


def remembered(url: str, model: str, words: int, pid: int, turns: int) -> dict[str, Any]:
    """The same conversation through the kv policy's memory of turns
    (``gateway.request.turns``): each turn known from the one before when at most a third
    of it is new, else tokenized whole. vLLM's CPU for the turns tokenized, the gateway's
    for the digests and the lookups, and how many turns were tokenized."""
    from gateway.request.turns import Turns
    from gateway.request.turns import conversation as digested
    step = max(1, words // turns)
    memory, messages = Turns(), []
    asked, mine = 0, 0.0
    cpu0 = ticks(pid)
    for t in range(turns):
        messages.append({"role": "user", "content": " ".join(
            WORDS[(t + i) % len(WORDS)] for i in range(step))})
        began = time.process_time()
        talk = digested(model, {"messages": messages})
        assert talk is not None
        known = memory.recall(talk)
        mine += time.process_time() - began
        if known is None:
            raw, _ = post(url + "/tokenize", {"model": model, "messages": messages})
            asked += 1
            memory.keep(talk, loads(raw)["tokens"])
        messages.append({"role": "assistant", "content": f"Answer {t}."})
    return {"turns": turns, "tokenized_turns": asked,
            "remembered_vllm_cpu_ms": round((ticks(pid) - cpu0) * 1000, 1),
            "remembered_gateway_cpu_ms": round(mine * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pid", type=int, required=True, help="the vLLM server's pid")
    parser.add_argument("--local", help="the model directory, for a local tokenizer")
    parser.add_argument("-n", type=int, default=50)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for target in SIZES:
        words = sized(args.url, args.model, target)
        post(args.url + "/tokenize", {"model": args.model, "messages": chat(words, 999)})
        row = {"target": target, **remote(args.url, args.model, words, args.pid, args.n)}
        if args.local:
            row.update(local(args.local, args.url, args.model, words, args.n))
        rows.append(row)
        print(json.dumps(row), flush=True)
    words = sized(args.url, args.model, SIZES[-1])
    talk = conversation(args.url, args.model, words, args.pid, args.turns)
    if importlib.util.find_spec("orjson") is not None:  # the gateway's venv
        talk.update(remembered(args.url, args.model, words, args.pid, args.turns))
    print(json.dumps(talk), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sizes": rows, "conversation": talk}, f, indent=1)


if __name__ == "__main__":
    main()
