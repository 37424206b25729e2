"""``routing.policy = "kv"`` through the real proxy (in-memory upstream and index): a
request goes to the backend that holds its prompt's prefix, as the index fed by vLLM's
events says, unless that backend is over its share; what can't be known (no tokenizer,
another route, a salted cache) goes to the least loaded."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.build import Parts
from gateway.kv.events import decode
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
    assert parts.serving is not None and parts.serving.feeds is not None
    parts.serving.feeds.index.apply(backend, decode(encode([stored(
        list(range(1, blocks + 1)), PROMPT[:4 * blocks])])))


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
    body: dict[str, Any] = {**BODY, "cache_salt": "s"} if case == "salted" else BODY
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
    assert (value("gateway_kv_event_age_seconds", backend="a") or -1) >= 0
