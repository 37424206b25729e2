"""OpenAI replies between their two shapes: a finished stream folded into one completion
object (to keep it), and a completion object played back as a stream (to serve it).

Only used off the hot path: after a stream ended, or for a degraded reply.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"


def _events(data: bytes) -> list[bytes]:
    out = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def fold(path: str, data: bytes) -> bytes | None:
    """A complete SSE reply (ending in ``[DONE]``) as the non-streaming completion object;
    None when it is not one the cache can replay faithfully (error, tool calls, cut off)."""
    chat = path == CHAT
    first: dict[str, Any] | None = None
    usage = None
    choices: dict[int, dict[str, Any]] = {}
    done = False
    for payload in _events(data):
        if payload == b"[DONE]":
            done = True
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or "error" in obj:
            return None
        first = first or obj
        usage = obj.get("usage") or usage
        for ch in obj.get("choices") or ():
            acc = choices.setdefault(int(ch.get("index", 0)), {"parts": [], "finish": None})
            piece = ch.get("delta") or {} if chat else ch
            if chat and piece.get("tool_calls"):
                return None
            text = piece.get("content" if chat else "text")
            if text:
                acc["parts"].append(text)
            acc["finish"] = ch.get("finish_reason") or acc["finish"]
    if not done or first is None or not choices:
        return None
    out_choices = [
        {"index": i, "message": {"role": "assistant", "content": "".join(c["parts"])},
         "logprobs": None, "finish_reason": c["finish"]} if chat else
        {"index": i, "text": "".join(c["parts"]), "logprobs": None,
         "finish_reason": c["finish"]}
        for i, c in sorted(choices.items())
    ]
    return orjson.dumps({
        "id": first.get("id"), "object": "chat.completion" if chat else "text_completion",
        "created": first.get("created"), "model": first.get("model"),
        "choices": out_choices, "usage": usage,
    })


def unfold(path: str, body: bytes, include_usage: bool) -> bytes:
    """A completion object as the SSE stream the client asked for, ``[DONE]`` included."""
    obj = orjson.loads(body)
    chat = path == CHAT
    base = {"id": obj.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": obj.get("created"), "model": obj.get("model")}
    out = []
    for ch in obj.get("choices") or ():
        index = ch.get("index", 0)
        if chat:
            message = ch.get("message") or {}
            first = {"index": index, "delta": {"role": "assistant",
                                               "content": message.get("content") or ""},
                     "logprobs": None, "finish_reason": None}
            last = {"index": index, "delta": {}, "logprobs": None,
                    "finish_reason": ch.get("finish_reason")}
        else:
            first = {"index": index, "text": ch.get("text") or "", "logprobs": None,
                     "finish_reason": None}
            last = {"index": index, "text": "", "logprobs": None,
                    "finish_reason": ch.get("finish_reason")}
        out.append(b"data: " + orjson.dumps({**base, "choices": [first]}) + b"\n\n")
        out.append(b"data: " + orjson.dumps({**base, "choices": [last]}) + b"\n\n")
    if include_usage and obj.get("usage"):
        out.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": obj["usage"]})
                   + b"\n\n")
    out.append(DONE)
    return b"".join(out)


def static_reply(path: str, model: str, message: str, rid: str) -> bytes:
    """The configured static message as a completion object of the route's kind."""
    chat = path == CHAT
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": message}} if chat
        else {"index": 0, "text": message})
    choice.update(logprobs=None, finish_reason="stop")
    return orjson.dumps({
        "id": f"{'chatcmpl' if chat else 'cmpl'}-degraded-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": [choice],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    })
