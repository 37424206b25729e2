"""Folding a finished stream into one completion, and playing one back as a stream."""

from __future__ import annotations

import orjson

from gateway.resilience.sse import fold, static_reply, unfold

CHAT = "/v1/chat/completions"


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(content: str | None, finish: str | None = None, **extra: object) -> bytes:
    delta = {} if content is None else {"content": content}
    return event({"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


STREAM = (chat_chunk("Hel") + chat_chunk("lo") + chat_chunk(None, "stop")
          + event({"id": "c1", "choices": [], "usage": {"total_tokens": 3}}) + b"data: [DONE]\n\n")


def test_a_chat_stream_folds_into_its_completion() -> None:
    body = fold(CHAT, STREAM)
    assert body is not None
    obj = orjson.loads(body)
    assert obj["object"] == "chat.completion" and obj["id"] == "c1"
    assert obj["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                               "logprobs": None, "finish_reason": "stop"}]
    assert obj["usage"] == {"total_tokens": 3}


def test_a_text_stream_folds_too() -> None:
    chunks = b"".join(event({"id": "t", "choices": [{"index": 0, "text": t,
                                                      "finish_reason": f}]})
                      for t, f in (("a", None), ("b", "length"))) + b"data: [DONE]\n\n"
    obj = orjson.loads(fold("/v1/completions", chunks) or b"null")
    assert obj["choices"][0]["text"] == "ab" and obj["choices"][0]["finish_reason"] == "length"


def test_cut_off_errored_or_tool_call_streams_are_not_kept() -> None:
    assert fold(CHAT, STREAM.removesuffix(b"data: [DONE]\n\n")) is None
    assert fold(CHAT, chat_chunk("a") + event({"error": {"message": "x"}})
                + b"data: [DONE]\n\n") is None
    tool = event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert fold(CHAT, tool + b"data: [DONE]\n\n") is None


def test_unfold_plays_a_completion_back_as_a_stream_that_folds_to_the_same() -> None:
    body = fold(CHAT, STREAM)
    assert body is not None
    stream = unfold(CHAT, body, include_usage=True)
    assert stream.endswith(b"data: [DONE]\n\n")
    assert fold(CHAT, stream) == body


def test_static_reply_has_the_route_shape() -> None:
    chat = orjson.loads(static_reply(CHAT, "m", "busy, try later", "r1"))
    assert chat["choices"][0]["message"]["content"] == "busy, try later"
    text = orjson.loads(static_reply("/v1/completions", "m", "later", "r1"))
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "later"
