"""The pieces of stream continuation: who may be continued, the partial answer folded from
the relayed chunks however they were cut, the continuation request, and the seam filter."""

from __future__ import annotations

import orjson
import pytest

from gateway.resilience.resume import Partial, Seam, continuation, eligible, fold
from tests.factories import request

CHAT = "/v1/chat/completions"
BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def event(obj: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def delta(text: str, **more: object) -> bytes:
    return event({**BASE, "choices": [{"index": 0, "delta": {"content": text, **more},
                                       "finish_reason": None}]})


ROLE = event({**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}]})


def chat_request(**payload: object) -> object:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}],
            **payload}
    return request(path=CHAT, stream=True, payload=body, body=orjson.dumps(body))


@pytest.mark.parametrize(("payload", "mode", "expected"), [
    ({"temperature": 0}, "deterministic", True),
    ({"seed": 7, "temperature": 0.8}, "deterministic", True),
    ({"temperature": 0.8}, "deterministic", False),
    ({}, "deterministic", False),  # vLLM samples by default
    ({"temperature": 0.8}, "always", True),
    ({"temperature": 0}, "off", False),
    ({"temperature": 0, "n": 2}, "always", False),
    ({"temperature": 0, "logprobs": True}, "always", False),
    ({"temperature": 0, "response_format": {"type": "json_object"}}, "always", False),
    ({"temperature": 0, "guided_regex": "a+"}, "always", False),
    ({"temperature": 0, "tools": [{"type": "function"}]}, "always", False),
    ({"temperature": 0, "tools": [{"type": "function"}], "tool_choice": "none"}, "always", True),
    ({"temperature": 0, "continue_final_message": True}, "always", False),
])
def test_who_may_be_continued(payload: dict[str, object], mode: str, expected: bool) -> None:
    assert eligible(chat_request(**payload), mode) is expected  # type: ignore[arg-type]


def test_fold_reads_the_text_however_the_bytes_were_cut() -> None:
    stream = ROLE + delta("Grüß") + delta(" 🙂") + delta(" dich")
    for size in (1, 2, 3, 5, 7, len(stream)):
        parts = [stream[i:i + size] for i in range(0, len(stream), size)]
        partial = fold(CHAT, parts)
        assert isinstance(partial, Partial)
        assert (partial.text, partial.tokens, partial.events) == ("Grüß 🙂 dich", 3, 4)
        assert (partial.id, partial.created, partial.model) == ("chatcmpl-1", 7, "m")


@pytest.mark.parametrize(("stream", "why"), [
    (ROLE + delta("a")[:-3], "cut event"),  # the client holds half an event
    (ROLE + delta("", tool_calls=[{"index": 0}]), "tool calls"),
    (ROLE + b'data: {"error": {"message": "x"}}\n\n', "error"),
    (ROLE + delta("", reasoning_content="Hmm"), "reasoning"),
    (ROLE + delta("", reasoning="Hmm"), "reasoning"),
])
def test_fold_refuses_what_cannot_be_continued(stream: bytes, why: str) -> None:
    assert fold(CHAT, [stream]) == why


def test_a_stream_the_client_has_whole_folds_as_done() -> None:
    partial = fold(CHAT, [ROLE + delta("Hi") + b"data: [DONE]\n\n"])
    assert isinstance(partial, Partial) and partial.done and partial.finished


def test_only_the_headers_fold_to_an_empty_partial() -> None:
    partial = fold(CHAT, [])
    assert isinstance(partial, Partial) and partial.events == 0 and partial.text == ""


def test_the_continuation_asks_for_the_rest() -> None:
    original = chat_request(temperature=0, max_tokens=10, min_tokens=5)
    partial = fold(CHAT, [ROLE + delta("Hel") + delta("lo")])
    assert isinstance(partial, Partial)
    asked = orjson.loads(continuation(original, partial).body)
    assert asked["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert asked["continue_final_message"] is True and asked["add_generation_prompt"] is False
    assert (asked["max_tokens"], asked["min_tokens"]) == (8, 3)
    done = fold(CHAT, [ROLE + delta("a") * 6])
    assert isinstance(done, Partial)
    assert orjson.loads(continuation(original, done).body)["min_tokens"] == 0
    body = {"model": "m", "prompt": "Say", "stream": True, "max_tokens": 3}
    completion = request(path="/v1/completions", stream=True, payload=body)
    text = fold("/v1/completions", [event({**BASE, "choices": [{"index": 0, "text": " hi"}]})])
    assert isinstance(text, Partial)
    assert orjson.loads(continuation(completion, text).body) == {**body, "prompt": "Say hi",
                                                                  "max_tokens": 2}


def test_the_seam_makes_the_continuation_part_of_the_clients_stream() -> None:
    partial = fold(CHAT, [ROLE + delta("Hel")])
    assert isinstance(partial, Partial)
    other = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 9, "model": "x"}
    cont = (event({**other, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""}}]})
            + event({**other, "choices": [{"index": 0, "delta": {"content": "lo"}}]})
            + event({**other, "choices": [], "usage": {"prompt_tokens": 12,
                                                       "completion_tokens": 1}})
            + b"data: [DONE]\n\n")
    for size in (1, 4, len(cont)):
        seam = Seam(chat_request(stream_options={"include_usage": True}), partial)
        out = b"".join(seam.feed(cont[i:i + size]) for i in range(0, len(cont), size))
        out += seam.flush()
        events = out.split(b"\n\n")[:-1]
        assert events[-1] == b"data: [DONE]"
        objs = [orjson.loads(e[6:]) for e in events[:-1]]
        assert [(o["id"], o["created"], o["model"]) for o in objs] == [("chatcmpl-1", 7, "m")] * 2
        assert objs[0]["choices"][0]["delta"] == {"content": "lo"}  # no second role chunk
        assert objs[1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 2,
                                    "total_tokens": 13}
        assert seam.usage == (11, 2)


def test_a_continuation_before_any_event_names_the_clients_model() -> None:
    """The break came before the client got an event: the continuation's own id stands, but
    the backend's name for the model (an alias's served name) is replaced by the client's."""
    partial = fold(CHAT, [])
    assert isinstance(partial, Partial)
    served = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 9,
              "model": "served-name"}
    seam = Seam(chat_request(), partial)
    out = seam.feed(event({**served, "choices": [{"index": 0, "delta": {"content": "x"}}]}))
    obj = orjson.loads(out.split(b"\n\n")[0][6:])
    assert (obj["id"], obj["model"]) == ("chatcmpl-2", chat_request().model)
