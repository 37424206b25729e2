"""``routing.policy = "kv"`` end to end with simulators that keep a prefix cache and publish
it as vLLM 0.32's KV events (``--kv-events``, replays on ``--kv-replay``), and report the
cached tokens of each reply (``--token-details``): the gateway (a worker per core, as
shipped) routes by what each one holds and predicts vLLM's ``cached_tokens``, through
evictions and lost batches. Real vLLM: tests/integration/test_real_vllm_kv.py."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, http_ok, metric, wait_for

BLOCK = 16


@pytest.fixture(scope="module")
def sockets() -> Iterator[Path]:
    """A short directory for the unix sockets (a socket path is limited to 108 bytes)."""
    where = Path(tempfile.mkdtemp(prefix="kv-"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def sims(tmp: Path, sockets: Path, tag: str, n: int, *options: str) -> list[Sim]:
    return [Sim(tmp, f"{tag}{i}", "--kv-events", f"ipc://{sockets}/{tag}{i}.pub",
                "--kv-replay", f"ipc://{sockets}/{tag}{i}.replay", "--token-details",
                "--kv-block", str(BLOCK), *options) for i in range(n)]


def gateway(tmp: Path, sockets: Path, tag: str, group: list[Sim], policy: str = "kv",
            replay: bool = True) -> Gateway:
    backends = "".join(
        f'[[backends]]\nname = "{tag}{i}"\nurl = "{sim.url}"\n'
        f'kv_events = "ipc://{sockets}/{tag}{i}.pub"\n'
        + (f'kv_replay = "ipc://{sockets}/{tag}{i}.replay"\n' if replay else "")
        for i, sim in enumerate(group))
    gw = Gateway(tmp, f'[routing]\npolicy = "{policy}"\nkv_header = true\n'
                 '[health]\ninterval = 0.3\n' + backends,
                 name=f"kv-{tag}-{policy}", workers=None)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 20, "gateway ready")
    return gw


def document(k: int) -> str:
    return f"Document {k}: " + " ".join(f"line {i} of document {k} is here." for i in range(12))


def ask(gw: Gateway, documents: int, rounds: int, first: int = 0) -> list[dict[str, Any]]:
    """Each document asked ``rounds`` times, round by round, no session key: what came back
    after the first round (the backend, the prediction, vLLM's figure)."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    out = []
    for r in range(rounds):
        for k in range(first, first + documents):
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model", max_tokens=1,
                messages=[{"role": "system", "content": document(k)},
                          {"role": "user", "content": f"Question {r}?"}])
            usage = raw.parse().usage
            assert usage is not None and usage.prompt_tokens_details is not None
            if r:
                out.append({"backend": raw.headers["x-gateway-backend"],
                            "predicted": int(raw.headers.get("x-gateway-cached-tokens", -1)),
                            "cached": usage.prompt_tokens_details.cached_tokens})
    return out


def ready(gw: Gateway, backend: str) -> bool:
    backends = httpx.get(gw.url + "/admin/status").json()["backends"]
    return any(b["name"] == backend and b["state"] == "ready" for b in backends)


def exact(results: list[dict[str, Any]]) -> int:
    return sum(r["predicted"] == r["cached"] for r in results)


def test_prompts_go_where_their_prefix_is_cached_and_the_prediction_holds(
        tmp_path: Path, sockets: Path) -> None:
    group = sims(tmp_path, sockets, "a", 3)
    kv = gateway(tmp_path, sockets, "a", group)
    try:
        results = ask(kv, 7, 3)
        assert all(r["cached"] >= 8 * BLOCK for r in results)  # each found its document
        assert exact(results) == len(results)
        shown = {b["name"]: b["kv"] for b in httpx.get(kv.url + "/dashboard/data").json()
                 ["backends"]}  # what the status page shows, per backend
        assert {row["standing"] for row in shown.values()} == {"exact"}
        assert sum(row["blocks"] for row in shown.values()) >= 7 * 8
        rr = gateway(tmp_path, sockets, "a", group, policy="round_robin")
        try:  # other documents: 7 of them over 3 backends, each round elsewhere
            spread = ask(rr, 7, 3, first=100)
        finally:
            rr.stop()
        assert sum(r["cached"] >= 8 * BLOCK for r in spread) < len(spread)
    finally:
        kv.stop()
        for sim in group:
            sim.stop()


def test_evicted_blocks_are_not_predicted(tmp_path: Path, sockets: Path) -> None:
    """Caches of 40 blocks, 10 documents of about 25 blocks: each new document evicts older
    ones. The index follows vLLM's BlockRemoved, so no prediction counts blocks that are gone."""
    group = sims(tmp_path, sockets, "e", 2, "--kv-blocks", "40")
    kv = gateway(tmp_path, sockets, "e", group)
    try:
        results = ask(kv, 10, 2)
        assert exact(results) == len(results)
        assert sum(r["cached"] for r in results) < sum(len(document(k)) for k in range(10))
        assert metric(kv.url, "gateway_kv_predictions_total", result="over") == 0
    finally:
        kv.stop()
        for sim in group:
            sim.stop()


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "no-replay"])
def test_lost_batches_are_replayed_or_their_backend_forgotten(
        tmp_path: Path, sockets: Path, replay: bool) -> None:
    """Every third batch lost on the way: with the replay endpoint the gap is filled and
    the predictions stay exact; without it the backend's blocks are dropped (a prediction
    may then say less than vLLM finds, never more)."""
    tag = "r" if replay else "n"
    group = sims(tmp_path, sockets, tag, 2, "--kv-drop", "3")
    kv = gateway(tmp_path, sockets, tag, group, replay=replay)
    try:
        results = ask(kv, 9, 3)
        assert all(r["predicted"] <= r["cached"] for r in results)
        what = "replayed" if replay else "resets"
        # The control process's feeds' counts reach the workers' gauges within a second.
        wait_for(lambda: max(metric(kv.url, "gateway_kv_feed", backend=f"{tag}{i}", what=what)
                             for i in range(2)) >= 1, 10, f"a batch {what}")
        if replay:
            assert exact(results) == len(results)
    finally:
        kv.stop()
        for sim in group:
            sim.stop()


def test_a_restarted_backend_starts_again_from_an_empty_cache(tmp_path: Path,
                                                             sockets: Path) -> None:
    """A simulator restarted on its port and socket: its events start again from seq 0 and
    the gateway forgets what it held. Requests sent there before that first event arrives
    are predicted hits and find misses (counted "over"; their answers are right, only
    slower); once the restart is known, every prediction is exact again."""
    group = sims(tmp_path, sockets, "s", 2)
    kv = gateway(tmp_path, sockets, "s", group)
    try:
        first = ask(kv, 4, 2)
        assert exact(first) == len(first)
        victim = first[0]["backend"]
        i = int(victim[1:])
        resets = lambda: metric(kv.url, "gateway_kv_feed", backend=victim,  # noqa: E731
                                what="resets")
        before = resets()
        group[i].stop()
        group[i] = Sim(tmp_path, f"s{i}-again", "--kv-events", f"ipc://{sockets}/s{i}.pub",
                       "--kv-replay", f"ipc://{sockets}/s{i}.replay", "--token-details",
                       "--kv-block", str(BLOCK), port=group[i].port)
        wait_for(lambda: ready(kv, victim), 10, "the restarted simulator routable again")
        # Either its health checks saw it down (its feed stopped, its blocks dropped, and a
        # new feed started when it was back) or its new events say it restarted (the first
        # ones may be sent before the subscription is back: asked until one arrives).
        # Each serving process learns it on its own (its own feed): a round with no "over"
        # after the reset counted, three rounds running, each on a new connection (any
        # process), says they all have.
        over = lambda: metric(kv.url, "gateway_kv_predictions_total",  # noqa: E731
                              result="over")

        def settled() -> bool:
            was = over()
            ask(kv, 4, 1)
            return resets() > before and over() == was
        wait_for(lambda: all(settled() for _ in range(3)), 20, "the restart noticed",
                 every=0.1)
        was = over()
        again = ask(kv, 4, 2, first=0)
        assert exact(again) == len(again)
        assert over() == was
    finally:
        kv.stop()
        for sim in group:
            sim.stop()


def test_a_conversation_is_routed_by_its_history_without_tokenizing_it_again(
        tmp_path: Path, sockets: Path) -> None:
    """An SDK client resends the whole conversation each turn (no session key): after the
    first, each turn goes where its history is cached, known from the turn before (no
    /tokenize), and its prediction is a lower bound of what the simulator finds."""
    group = sims(tmp_path, sockets, "t", 3)
    kv = gateway(tmp_path, sockets, "t", group)
    try:
        client = openai.OpenAI(base_url=kv.url + "/v1", api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "system", "content": document(1)}]
        seen = []
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question {turn}?"})
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model", max_tokens=4, messages=messages)
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            seen.append((raw.headers["x-gateway-backend"],
                         int(raw.headers["x-gateway-cached-tokens"]),
                         reply.usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert len({backend for backend, _, _ in seen}) == 1, seen
        assert all(0 < predicted <= cached for _, predicted, cached in seen[1:]), seen
        wait_for(lambda: metric(kv.url, "gateway_kv_lookups", result="remembered") >= 3, 10,
                 "turns routed by the turn before (one may meet the other worker process)")
    finally:
        kv.stop()
        for sim in group:
            sim.stop()


def test_every_worker_counts_the_prefill_pending_in_all_of_them(tmp_path: Path,
                                                                sockets: Path) -> None:
    """Two serving processes, five streams of prompts cached nowhere (no two share a
    block), each waiting 10 s for its first token: whichever process is asked, the tokens
    pending on the backends are all five prompts' (the map the workers share), not what
    that process sent times two (no part of the five sizes adds up to half of them)."""
    group = sims(tmp_path, sockets, "w", 2, "--ttft", "10")
    config = ('[routing]\npolicy = "kv"\n[health]\ninterval = 0.3\n'
              + "".join(f'[[backends]]\nname = "w{i}"\nurl = "{sim.url}"\n'
                        f'kv_events = "ipc://{sockets}/w{i}.pub"\n'
                        f'kv_replay = "ipc://{sockets}/w{i}.replay"\n'
                        for i, sim in enumerate(group)))
    bodies = [{"model": "sim-model", "max_tokens": 1, "stream": True,
               "messages": [{"role": "user", "content": "abcde"[k] * (300 * 2 ** k)}]}
              for k in range(5)]
    statuses: list[int] = []
    gw: Gateway | None = None

    def stream(body: dict[str, Any]) -> None:
        assert gw is not None
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                          timeout=30) as reply:
            reply.read()
            statuses.append(reply.status_code)

    def pending() -> int:  # a new connection: either process answers
        assert gw is not None
        rows = httpx.get(gw.url + "/dashboard/data").json()["backends"]
        return sum(row["kv"]["prefill_pending"] for row in rows)

    try:
        tokens = [httpx.post(group[0].url + "/tokenize", json={
            "model": b["model"], "messages": b["messages"]}).json()["count"] for b in bodies]
        total = sum(tokens)
        assert all(2 * sum(part) != total for n in range(6)
                   for part in itertools.combinations(tokens, n))
        gw = Gateway(tmp_path, config, name="kv-pending", workers=2)
        wait_for(lambda: all(row["state"] == "ready" and row["kv"]["standing"] == "exact"
                             for row in httpx.get(gw.url + "/dashboard/data").json()
                             ["backends"]), 20, "both backends exact")
        threads = [threading.Thread(target=stream, args=(b,), daemon=True) for b in bodies]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(pending() == total for _ in range(6)), 8,
                 f"{total} tokens pending, seen from six connections")
        for thread in threads:
            thread.join(30)
        assert statuses == [200] * 5
        wait_for(lambda: all(pending() == 0 for _ in range(6)), 5, "nothing pending")
    finally:
        if gw is not None:
            gw.stop()
        for sim in group:
            sim.stop()
