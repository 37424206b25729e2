"""``routing.policy = "kv"`` through the real proxy (in-memory upstream and index): a
request goes to the backend that holds its prompt's prefix, as the index fed by vLLM's
events says, unless that backend is over its share; what can't be known (no tokenizer,
another route, a salted cache) goes to the least loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.build import Parts
from gateway.kv.events import decode
from gateway.kv.feed import Feed, Feeds
from gateway.kv.index import Index
from gateway.kv.pending import Pending, create
from gateway.kv.prefill import PRIOR, Prefill
from gateway.request.cache import CacheLookup
from tests import factories
from tests.fakes import FakeUpstream, Reply, always, call, completion
from tests.gateway.kv.wire import encode, recorded, stored
from tests.gateway.proxy.test_proxy import A, B, gateway

PROMPT = [7] * 8 + [9] * 3  # two full blocks of 4, and a partial one
BODY = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}


def tokenizer(tokens: list[int]) -> Any:
    return always(Reply.json(200, {"count": len(tokens), "max_model_len": 1024,
                                   "tokens": tokens}))


def kv_gateway(upstream: FakeUpstream, explain: bool = True) -> Parts:
    return gateway(upstream, routing={"sticky": False, "policy": "kv", "kv_header": explain})


def holds(parts: Parts, backend: str, blocks: int) -> None:
    """``backend`` said (in vLLM's words) it cached the first ``blocks`` of PROMPT."""
    feeds = fed(parts, backend)
    feeds.index.apply(backend, decode(encode([stored(
        list(range(1, blocks + 1)), PROMPT[:4 * blocks])])))


def fed(parts: Parts, backend: str) -> Feeds:
    """The gateway's feeds, with one for ``backend`` in step (as after its first replay)."""
    assert parts.serving is not None and parts.serving.feeds is not None
    feeds = parts.serving.feeds
    if backend not in feeds.feeds:
        feeds.feeds[backend] = feed = Feed(backend, feeds.index, "ipc:///nowhere")
        feed.synced = True
    return feeds


def served_by(parts: Parts, body: dict[str, Any] = BODY,
              path: str = "/v1/chat/completions") -> str:
    """The backend that answered; with the tokens it was predicted to hold, when known."""
    async def one() -> str:
        answered = await call(parts.proxy, body, path=path)
        assert answered.status == 200
        predicted = answered.headers.get("x-gateway-cached-tokens")
        backend = answered.headers["x-gateway-backend"]
        return backend if predicted is None else f"{backend}:{predicted}"
    return asyncio.run(asyncio.wait_for(one(), 10))


def test_the_backend_holding_the_longest_prefix_takes_the_request() -> None:
    upstream = FakeUpstream({A: always(completion("a")), B: always(completion("b"))},
                            {A: tokenizer(PROMPT), B: tokenizer(PROMPT)})
    parts = kv_gateway(upstream)
    assert served_by(parts) == "a:0"  # nothing cached anywhere: the least loaded (a tie)
    holds(parts, "a", 1)
    holds(parts, "b", 2)
    assert [served_by(parts) for _ in range(3)] == ["b:8"] * 3  # two blocks of 4 tokens
    quiet = kv_gateway(upstream, explain=False)  # the default: no tenant learns of others
    holds(quiet, "b", 2)
    assert served_by(quiet) == "b"


def test_what_the_tokenizer_is_asked_is_the_chat_as_vllm_renders_it() -> None:
    asked: list[bytes] = []

    async def tokenize(body: bytes) -> Reply:
        asked.append(body)
        return Reply.json(200, {"tokens": PROMPT})

    upstream = FakeUpstream({A: always(completion()), B: always(completion())},
                            {A: tokenize, B: tokenize})
    parts = kv_gateway(upstream)
    body = {**BODY, "add_generation_prompt": True, "chat_template_kwargs": {"x": 1},
            "temperature": 0.5}
    assert served_by(parts, body) == "a:0"
    assert orjson.loads(asked[0]) == {"messages": BODY["messages"],
                                      "add_generation_prompt": True,
                                      "chat_template_kwargs": {"x": 1}}
    served_by(parts, {"model": "m", "prompt": "once", "max_tokens": 1}, "/v1/completions")
    assert orjson.loads(asked[1]) == {"prompt": "once", "add_special_tokens": True}


@pytest.mark.parametrize("case", ["no tokenizer", "tokenizer error", "salted", "embeddings"])
def test_what_cannot_be_known_goes_to_the_least_loaded(case: str) -> None:
    tokenizers = {} if case == "no tokenizer" else {
        A: always(Reply.json(500 if case == "tokenizer error" else 200, {"tokens": PROMPT})),
        B: always(Reply.json(500 if case == "tokenizer error" else 200, {"tokens": PROMPT}))}
    upstream = FakeUpstream({A: always(completion()), B: always(completion())}, tokenizers)
    parts = kv_gateway(upstream)
    holds(parts, "b", 2)
    body: dict[str, Any] = {**BODY, "cache_salt": 5} if case == "salted" else BODY
    path = "/v1/chat/completions"
    if case == "embeddings":
        body, path = {"model": "m", "input": "hello"}, "/v1/embeddings"
    assert served_by(parts, body, path) == "a"  # b holds the prefix, but nobody knows


def test_a_prompt_just_sent_draws_the_next_ones_before_its_events_come() -> None:
    """Nothing cached yet, and vLLM's events are slower than the next requests: the blocks
    of a prompt just dispatched count where it went (for a few seconds), so a burst of one
    prefix goes to one place instead of being spread by load."""
    upstream = FakeUpstream({A: always(completion("a")), B: always(completion("b"))},
                            {A: tokenizer(PROMPT), B: tokenizer(PROMPT)})
    parts = kv_gateway(upstream)
    assert parts.serving is not None and parts.serving.feeds is not None
    index = parts.serving.feeds.index
    for backend in ("a", "b"):  # their block size is known (4): each has sent an event
        index.apply(backend, decode(encode([stored([99], [1, 2, 3, 4])])))
    assert [served_by(parts) for _ in range(3)] == ["a:0", "a:8", "a:8"]
    other = kv_gateway(FakeUpstream({A: always(completion()), B: always(completion())}))
    assert [served_by(other) for _ in range(2)] == ["a", "b"]  # by load alone: spread


def test_each_feed_is_shown_in_the_metrics() -> None:
    parts = kv_gateway(FakeUpstream())
    assert parts.serving is not None and parts.serving.feeds is not None
    feeds = parts.serving.feeds

    async def fed() -> None:
        feeds.align({"a": ("ipc:///nowhere/a", None), "b": ("ipc:///nowhere/b", None)})
        await feeds.feeds["a"].receive([b"kv", bytes(8), recorded(0)])
        await feeds.feeds["a"].receive([b"kv", (3).to_bytes(8, "big"), recorded(4)])  # a gap
        parts.status.refresh()
        feeds.align({})
    asyncio.run(fed())

    def value(name: str, **labels: str) -> float | None:
        return parts.metrics.registry.get_sample_value(name, labels)
    assert value("gateway_kv_blocks", backend="a") == 2  # the 6 went with the reset
    assert value("gateway_kv_feed", backend="a", what="gaps") == 1
    assert value("gateway_kv_feed", backend="a", what="resets") == 1  # no replay endpoint
    assert value("gateway_kv_feed", backend="a", what="batches") == 2
    assert value("gateway_kv_event_age_seconds", backend="b") == -1
    assert value("gateway_kv_event_age_seconds", backend="a") >= 0


LONG = list(range(1, 41))  # 40 tokens: two blocks of 16 before the last token


def test_backends_without_events_are_routed_by_what_the_gateway_sent_there() -> None:
    """No events (a url backend without ``kv_events``): the prompts the gateway sent to a
    backend count there, so a repeated prefix still finds its instance; the rule that
    decided is said."""
    upstream = FakeUpstream({A: always(completion("a")), B: always(completion("b"))},
                            {A: tokenizer(LONG), B: tokenizer(LONG)})
    parts = kv_gateway(upstream)
    assert parts.serving is not None and parts.serving.feeds is not None
    assert parts.serving.feeds.standing("a") == "estimated"
    served = [served_by(parts) for _ in range(3)]  # first at its home, then where it went
    home = served[0].split(":")[0]
    assert served == [f"{home}:0", f"{home}:32", f"{home}:32"]

    async def rule() -> str:
        answered = await call(parts.proxy, BODY)
        return answered.headers["x-gateway-kv-rule"]
    assert asyncio.run(rule()) == "cached"


def test_a_backend_whose_predictions_keep_missing_is_routed_by_the_estimate() -> None:
    """Its feed is in step but says nothing of what vLLM keeps finding (events lost
    without a gap, a publisher that stopped): once the guesses of what was sent expire,
    the index predicts nothing where vLLM finds the prompt; after enough misses the
    backend is inexact and the estimate predicts it; once the index is right again, it is
    exact again."""
    now = [0.0]
    feeds = Feeds(Index(clock=lambda: now[0]))
    feeds.feeds["a"] = feed = Feed("a", feeds.index, "ipc:///nowhere")
    feed.synced = True
    feeds.index.apply("a", decode(encode([stored([99], [1, 2, 3, 4])])))  # block size 4
    lookup = CacheLookup(feeds, FakeUpstream(), kv_gateway(FakeUpstream()).pool)

    async def one(found: int) -> int:
        now[0] += 10  # past the guesses of the one before
        prediction = lookup.predict(PROMPT, ["a"])
        prediction.sent("a")
        prediction.ended("a", found)
        return prediction.cached.get("a", 0)

    async def main() -> None:
        assert [await one(8) for _ in range(10)] == [0] * 10  # the index: nothing there
        assert feeds.standing("a") == "inexact"
        assert await one(8) == 8  # the estimate: what was sent there
        feeds.index.apply("a", decode(encode([stored([1, 2], PROMPT[:8])])))  # said at last
        for _ in range(16):
            await one(8)
        assert feeds.standing("a") == "exact"
    asyncio.run(main())


BIG = list(range(1, 201))  # 200 tokens: twelve blocks of 16 before the last token


def test_the_prefill_a_backend_has_to_do_counts_until_its_first_byte() -> None:
    parts = kv_gateway(FakeUpstream())
    feeds = fed(parts, "a")
    lookup = CacheLookup(feeds, FakeUpstream(), parts.pool)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = lookup.predict(BIG, ["a"]), lookup.predict(BIG, ["a"])
        first.sent("a")
        second.sent("a")
        assert feeds.prefill.pending == {"a": 400}
        # 400 ahead (this process's: counted for each of its processes), and 8 of its
        # own: the 192 before them are guessed there (just sent)
        scale = feeds.prefill.scale
        assert lookup.predict(BIG, ["a"]).cached.waits["a"] == pytest.approx(
            (scale * 400 + 8) / PRIOR)
        first.began(loop.time() + 0.01, stream=True)  # 200 tokens in about 10 ms
        assert feeds.prefill.pending == {"a": 200}
        assert 15_000 < feeds.prefill.rate("a") <= 20_000
        second.began(loop.time() + 0.01, stream=False)  # a whole reply: no measurement
        second.ended("a", None)  # nothing released twice
        assert feeds.prefill.pending == {} and feeds.prefill.rate("a") <= 20_000
    asyncio.run(main())


def test_a_request_counts_in_flight_where_it_was_sent_until_it_ends(tmp_path: Path) -> None:
    """With the workers' shared map, each request counts once among the requests in flight
    on the backend it was last sent to (a retry moves it), until it ends; a prediction
    carries the other processes' counts for the kv policy's bounded load (this process's
    own are ``Backend.in_flight``, read live when the policy chooses)."""
    parts = kv_gateway(FakeUpstream())
    feeds = fed(parts, "a")
    create(str(tmp_path / "map"), 2)
    feeds.prefill = Prefill(2, Pending(str(tmp_path / "map"), 0))
    other = Prefill(2, Pending(str(tmp_path / "map"), 1))
    other.entered("a")  # another worker's request
    lookup = CacheLookup(feeds, FakeUpstream(), parts.pool)

    async def main() -> None:
        first, second = lookup.predict(BIG, ["a"]), lookup.predict(BIG, ["a"])
        first.sent("a")
        second.sent("b")
        second.sent("a")  # the attempt on b failed: moved
        assert feeds.prefill.requests == {"a": 2}  # b's count went back with the move
        assert other.others("a") == 2
        assert lookup.predict(BIG, ["a", "b"]).cached.others == {"a": 1}  # its own: live
        first.ended("a", 0)
        second.ended("a", 0)
        second.ended("a", 0)  # nothing released twice
        other.left("a")
        assert lookup.predict(BIG, ["a", "b"]).cached.others == {}
        assert feeds.prefill.requests == {}
    asyncio.run(main())


def test_a_salted_or_adapted_prompt_matches_only_blocks_of_its_salt_and_adapter() -> None:
    """vLLM keys a prompt's first block by its ``cache_salt`` and every block by its LoRA
    adapter, and says both in its events (``extra_keys``, ``lora_name``): a request finds
    only blocks cached under its own salt and adapter."""
    parts = kv_gateway(FakeUpstream())
    feeds = fed(parts, "a")
    lookup = CacheLookup(feeds, FakeUpstream(), parts.pool)
    feeds.index.apply("a", decode(encode([stored([1, 2], PROMPT[:8],
                                                 extra_keys=[["s"], None])])))
    feeds.index.apply("a", decode(encode([stored([3, 4], PROMPT[:8], lora_name="ad",
                                                 extra_keys=[["ad", "s"], ["ad"]])])))

    def cached(lora: str | None, salt: str | None) -> int:
        return lookup.predict(PROMPT, ["a"], lora, salt).cached.get("a", 0)
    assert cached(None, "s") == 8
    assert cached(None, "t") == 0  # another tenant's salt
    assert cached(None, None) == 0
    assert cached("ad", "s") == 8
    assert cached("ad", None) == 0
    assert cached("other", "s") == 0


def test_a_failed_attempts_guess_is_taken_back() -> None:
    """An attempt on a that failed before its first byte, then b: the prompt is guessed
    on b only (a never cached it)."""
    parts = kv_gateway(FakeUpstream())
    feeds = fed(parts, "a")
    fed(parts, "b")
    lookup = CacheLookup(feeds, FakeUpstream(), parts.pool)

    async def main() -> None:
        prediction = lookup.predict(BIG, ["a", "b"])
        prediction.sent("a")
        assert lookup.predict(BIG, ["a", "b"]).cached == {"a": 192}
        prediction.sent("b")  # the retry
        assert lookup.predict(BIG, ["a", "b"]).cached == {"b": 192}
        assert feeds.prefill.pending == {"b": 200}
    asyncio.run(main())


def test_a_conversations_later_turns_are_routed_by_its_history_without_tokenizing() -> None:
    """Turn 2 resends turn 1's messages: their tokens, remembered, route it to where they
    are cached, with no /tokenize; the prediction is a lower bound (the new turn is not
    counted) and is judged as one. A turn that adds much is tokenized whole again."""
    asked: list[bytes] = []

    async def tokenize(body: bytes) -> Reply:  # one token per character, in order
        asked.append(body)
        text = "".join(m["content"] for m in orjson.loads(body)["messages"])
        return Reply.json(200, {"tokens": [ord(c) for c in text]})

    upstream = FakeUpstream({A: always(completion("a")), B: always(completion("b"))},
                            {A: tokenize, B: tokenize})
    parts = kv_gateway(upstream)
    system = {"role": "system", "content": "abcd" * 10}  # ten blocks of 4
    first = {**BODY, "messages": [system, {"role": "user", "content": "q1"}]}
    feeds = fed(parts, "b")
    fed(parts, "a")
    feeds.index.apply("b", decode(encode([stored(list(range(1, 11)), [ord(c) for c in
                                                                      "abcd" * 10])])))
    assert served_by(parts, first) == "b:40" and len(asked) == 1
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "b"},
                                    {"role": "user", "content": "q2"}]}
    assert [served_by(parts, second) for _ in range(2)] == ["b:32"] * 2  # 42 - 8 kept: 8 blocks
    assert len(asked) == 1 and feeds.lookups["remembered"] == 2
    assert feeds.checks.inexact("b") is False
    third = {**second, "messages": [*second["messages"], {"role": "assistant", "content": "c"},
                                    {"role": "user", "content": "x" * 25}]}
    assert served_by(parts, third) == "b:40" and len(asked) == 2  # 29 of 71 new: asked


def test_an_adapters_prompt_is_keyed_by_the_adapter_also_through_an_alias() -> None:
    """A request for a declared adapter, or for a ``[[models]]`` alias of it, finds the
    blocks vLLM cached under the adapter's name (its events' ``lora_name``), even on an
    instance that does not list the adapter yet."""
    upstream = FakeUpstream({A: always(completion("x"))}, tokenizers={A: tokenizer(PROMPT)})
    parts = gateway(upstream, {"name": "a", "url": A, "lora": True},
                    routing={"sticky": False, "policy": "kv"},
                    adapters=[{"name": "ad", "base": "m", "path": "/srv/ad"}],
                    models=[{"name": "support", "groups": {"stable": "ad"}}])
    feeds = fed(parts, "a")
    feeds.index.apply("a", decode(encode([stored([3, 4], PROMPT[:8], lora_name="ad",
                                                 extra_keys=[["ad"], ["ad"]])])))
    lookup = CacheLookup(feeds, upstream, parts.pool)

    async def cached(model: str) -> int:
        request = factories.request(model=model, payload={**BODY, "model": model})
        prediction = await lookup(request, None)
        assert prediction is not None
        return prediction.cached.get("a", 0)

    async def main() -> None:
        assert await cached("ad") == 8
        assert await cached("support") == 8
        assert await cached("m") == 0  # the base model's blocks are its own
    asyncio.run(main())
