from __future__ import annotations

import base64
import struct

import msgspec
import pytest

from backends.sim.options import Fault, SimOptions
from backends.sim.prefix import BLOCK, PrefillQueue, PrefixCache
from backends.sim.replies import DIMENSIONS, embedding_vector, encode_vector, unknown_model
from backends.sim.validate import CHAT, EMBEDDINGS, Rejected, check_model, parse
from gateway.kv.events import Removed, Stored, decode
from tests.gateway.kv.wire import RECORDED, recorded

RECORDED_STORED = msgspec.msgpack.decode(recorded(RECORDED[0]["seq"]))[1][0]


def test_prefix_cache_counts_shared_prefixes_in_blocks() -> None:
    cache = PrefixCache()
    history = b"s" * (BLOCK * 4)
    assert cache.observe(history) == (0, BLOCK * 4)  # none hit, four blocks added
    assert cache.observe(history + b"t" * BLOCK) == (BLOCK * 4, BLOCK)
    assert cache.observe(b"x" + history)[0] == 0  # a prefix must match from the start
    assert cache.queries == 3 * BLOCK * 4 + BLOCK + 1
    assert cache.hits == BLOCK * 4


def test_x_sim_header_overrides() -> None:
    opts = SimOptions().override("fault=crash; after=3, ttft=0.5")
    assert (opts.fault, opts.after, opts.ttft) == (Fault.CRASH, 3, 0.5)
    opts = SimOptions().override("fault=cut,split=5")
    assert (opts.fault, opts.split) == (Fault.CUT, 5)
    with pytest.raises(ValueError):
        SimOptions().override("bogus=1")


def test_per_model_options() -> None:
    name, overrides = SimOptions.parse_model("slow-model:itl=0.25,tokens=4")
    opts = SimOptions(models=("sim-model", name), model_overrides=((name, overrides),))
    assert opts.for_model("slow-model").itl == 0.25
    assert opts.for_model("slow-model").tokens == 4
    assert opts.for_model("sim-model").itl == 0.0
    with pytest.raises(ValueError):
        SimOptions.parse_model("m:nope=1")


def test_requests_are_checked_in_vllms_order() -> None:
    assert parse(CHAT, "text/plain", b"{}") == Rejected(400, parse(CHAT, "", b"").body)
    bad = parse(CHAT, "application/json; charset=utf-8", b'{"a": ')
    assert isinstance(bad, Rejected) and b'"param":"body.6"' in bad.body
    missing = parse(CHAT, "application/json", b'{"model": "m"}')
    assert isinstance(missing, Rejected) and b'"param":"body.messages"' in missing.body
    body = parse(EMBEDDINGS, "application/json", b'{"model": "m", "input": "x"}')
    assert isinstance(body, dict)
    assert check_model(EMBEDDINGS, body, ("m",)) is None
    assert check_model(EMBEDDINGS, {"model": "n"}, ("m",)) == Rejected(404, unknown_model(
        "n", ("m",), pooling=True))
    assert check_model(CHAT, {}, ("m",)) is None


def test_base64_is_little_endian_float32_unless_asked_big() -> None:
    vector = embedding_vector("x")
    little = base64.b64decode(encode_vector(vector, "base64", "native"))
    big = base64.b64decode(encode_vector(vector, "base64", "big"))
    assert list(struct.unpack(f"<{DIMENSIONS}f", little)) == vector
    assert list(struct.unpack(f">{DIMENSIONS}f", big)) == vector
    assert encode_vector(vector, "float", "native") is vector


def test_the_prefix_cache_tells_what_it_stores_and_evicts_as_vllm_does() -> None:
    """Its events decode with the gateway's decoder of vLLM 0.32's (the same fields, in
    vLLM's order), chain by parent, and evict the least recently used past capacity."""
    sent: list[list[dict[str, object]]] = []
    cache = PrefixCache(capacity_blocks=3, block=4, publish=sent.append)
    cache.observe(b"abcdefgh")  # two blocks
    cache.observe(b"abcdefghij")  # both hit: nothing new, nothing sent
    cache.observe(b"abcdefghijkl")  # one more, chained to the second
    assert len(sent) == 2
    first, second = (decode(msgspec.msgpack.encode([1.0, e, 0])).events[0] for e in sent)
    assert isinstance(first, Stored) and isinstance(second, Stored)
    assert first.parent is None and tuple(first.tokens) == tuple(b"abcdefgh") and first.size == 4
    assert second.parent == first.hashes[-1] and tuple(second.tokens) == tuple(b"ijkl")
    assert list(sent[0][0]) == list(RECORDED_STORED)  # vLLM's fields, in vLLM's order
    cache.observe(b"zzzz")  # a fourth block: the least recently used goes
    removed = decode(msgspec.msgpack.encode([1.0, sent[-1], 0])).events
    assert [type(e).__name__ for e in removed] == ["Stored", "Removed"]
    assert removed[1] == Removed((first.hashes[0],), "GPU")


def test_prefill_rate_queues_each_prompts_uncached_tokens_behind_the_ones_before() -> None:
    """``--prefill-rate``: a request's first token comes after the prefill queued before it
    and its own uncached tokens at that rate, so a hit goes quicker than a miss and a hot
    instance queues (the kv policy's knee, simulated)."""
    now = [100.0]
    queue = PrefillQueue(clock=lambda: now[0])
    assert queue.wait(1_000, 10_000) == pytest.approx(0.1)  # a miss
    assert queue.wait(500, 10_000) == pytest.approx(0.15)  # behind it
    assert queue.wait(20, 10_000) == pytest.approx(0.152)  # a hit, behind both
    now[0] += 1.0  # the queue drained meanwhile
    assert queue.wait(20, 10_000) == pytest.approx(0.002)
