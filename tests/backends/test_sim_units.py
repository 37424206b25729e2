from __future__ import annotations

import base64
import struct

import pytest

from backends.sim.options import Fault, SimOptions
from backends.sim.prefix import BLOCK, PrefixCache
from backends.sim.replies import DIMENSIONS, embedding_vector, encode_vector, unknown_model
from backends.sim.validate import CHAT, EMBEDDINGS, Rejected, check_model, parse


def test_prefix_cache_counts_shared_prefixes_in_blocks() -> None:
    cache = PrefixCache()
    history = b"s" * (BLOCK * 4)
    assert cache.observe(history) == 0
    assert cache.observe(history + b"t" * BLOCK) == BLOCK * 4
    assert cache.observe(b"x" + history) == 0  # a prefix must match from the start
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
