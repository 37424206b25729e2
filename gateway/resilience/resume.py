"""Continuing a stream whose backend failed after it began: which requests may be continued,
what the client already has, the request that asks another backend for the rest, and the
filter that makes that backend's chunks part of the client's one stream.

vLLM continues a partial answer itself: a chat request whose last message is the partial
assistant text with ``continue_final_message`` (and no new generation prompt), or a
completion whose prompt is the original prompt followed by the text so far. Everything here
runs only when a stream broke: the normal path keeps its chunks by reference and no more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

from gateway.http.rewrite import whole_events
from gateway.resilience.sse import CHAT, DONE
from gateway.types import Request

COMPLETIONS = "/v1/completions"
Mode = Literal["off", "deterministic", "always"]
# Ways to constrain the output a continuation could not honour from the middle.
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs")


def _declines(payload: dict[str, Any], path: str) -> str | None:
    """Why this request's stream can't be continued whatever the mode, or None."""
    n = payload.get("n")
    if n not in (None, 1):
        return "n > 1"
    if payload.get("tools") and payload.get("tool_choice") != "none":
        return "tools"
    response_format = payload.get("response_format")
    if (response_format not in (None, {"type": "text"})
            or any(payload.get(k) is not None for k in STRUCTURED)):
        return "structured output"
    if payload.get("logprobs") or payload.get("top_logprobs") or payload.get("echo"):
        return "logprobs"
    if path == CHAT:
        if not isinstance(payload.get("messages"), list) or payload.get(
                "continue_final_message"):
            return "messages"
    elif not isinstance(payload.get("prompt"), str) or payload.get("suffix"):
        return "prompt"
    return None


def deterministic(payload: dict[str, Any]) -> bool:
    """Output that does not depend on sampling: greedy, or sampled from a fixed seed."""
    temperature = payload.get("temperature")
    return (isinstance(temperature, int | float) and not isinstance(temperature, bool)
            and temperature == 0) or (isinstance(payload.get("seed"), int))


def eligible(request: Request, mode: Mode) -> bool:
    """Cheap, once per streamed request when its relay begins: may it be continued?"""
    if mode == "off" or not request.stream or request.path not in (CHAT, COMPLETIONS):
        return False
    payload = request.payload
    if _declines(payload, request.path) is not None:
        return False
    return mode == "always" or deterministic(payload)


@dataclass(frozen=True, slots=True)
class Partial:
    """What the client got of a broken stream, folded from the relayed chunks."""

    id: object
    created: object
    model: object
    text: str  # the answer so far
    tokens: int  # events that carried text (vLLM sends a token, or a few, per event)
    finished: bool  # a finish_reason was sent: only the end of the stream is missing
    usage: bool  # the usage chunk was sent
    events: int  # data events the client got (0: only the headers)
    done: bool = False  # the client has ``[DONE]``: only the connection's end was missing


def _text(choice: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    """A choice's text, and why what it carried can't be continued (None: it can): a tool
    call, or reasoning (vLLM's reasoning parser: the continuation would not resume it)."""
    if chat:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        why = ("tool calls" if delta.get("tool_calls") else
               "reasoning" if delta.get("reasoning_content") or delta.get("reasoning") else None)
        return (content if isinstance(content, str) else ""), why
    text = choice.get("text")
    return (text if isinstance(text, str) else ""), None


def fold(path: str, parts: list[bytes]) -> Partial | str:
    """The partial answer in the chunks the client got, or why it can't be continued (a
    cut event, an error, a tool call, reasoning, a second choice)."""
    data = b"".join(parts)
    if data and not data.endswith(b"\n\n"):
        return "cut event"  # the client holds half an event: nothing can follow it
    chat = path == CHAT
    pieces: list[str] = []
    first: dict[str, Any] | None = None
    tokens, finished, usage, events = 0, False, False, 0
    for event in data.split(b"\n\n")[:-1]:
        line = event.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return Partial(None, None, None, "", 0, True, True, events, done=True)
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "unreadable"
        if not isinstance(obj, dict) or "error" in obj:
            return "error"
        first = first or obj
        events += 1
        usage = usage or bool(obj.get("usage"))
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return "choices"
            text, why = _text(choice, chat)
            if why is not None:
                return why
            if text:
                pieces.append(text)
                tokens += 1
            finished = finished or bool(choice.get("finish_reason"))
    if first is None:  # the headers alone: the continuation's own names will do
        first = {}
    return Partial(first.get("id"), first.get("created"), first.get("model"), "".join(pieces),
                   tokens, finished, usage, events)


def continuation(request: Request, partial: Partial) -> Request:
    """The request for the rest of the answer: the partial text as the assistant's unfinished
    message (chat) or after the prompt (completions), ``max_tokens`` and ``min_tokens``
    less what was sent."""
    payload: dict[str, Any] = dict(request.payload)
    if partial.text:
        if request.path == CHAT:
            payload["messages"] = [*payload["messages"],
                                   {"role": "assistant", "content": partial.text}]
            payload["continue_final_message"] = True
            payload["add_generation_prompt"] = False
        else:
            payload["prompt"] = str(payload["prompt"]) + partial.text
    for cap in ("max_tokens", "max_completion_tokens"):
        value = payload.get(cap)
        if isinstance(value, int) and not isinstance(value, bool):
            payload[cap] = max(1, value - partial.tokens)
    least = payload.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least:
        payload["min_tokens"] = max(0, least - partial.tokens)
    return replace(request, payload=payload, body=orjson.dumps(payload))


class Seam:
    """The continuation's stream rewritten into the client's: the first part's ``id``,
    ``created`` and ``model`` on every chunk, chat's opening role chunk left out (the client
    had it), the usage chunk counting both parts (completion tokens summed; prompt tokens
    the continuation's less the text it was given back), or taken out when the client did
    not ask for it. When the client had no event yet, the client's model name. Parses every
    event: used only after a stream broke."""

    __slots__ = ("_carry", "_chat", "_given", "_model", "_opened", "_partial", "_strip",
                 "usage")

    def __init__(self, request: Request, partial: Partial) -> None:
        self._partial = partial
        self._model = request.model
        self._chat = request.path == CHAT
        self._strip = request.strip_usage
        self._given = partial.tokens if partial.text else 0
        self._carry = b""
        self._opened = False
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> bytes:
        events, self._carry = whole_events(self._carry, chunk)
        return b"".join(self._event(e) for e in events.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        rest, self._carry = self._carry, b""
        return self._event(rest.strip()) if rest.strip() else b""

    def whole(self, body: bytes) -> bytes:
        return body

    def _event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return DONE if line.startswith(b"data:") else b""
        try:
            obj = orjson.loads(line[5:].strip())
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        p = self._partial
        if p.events:
            obj.update(id=p.id, created=p.created, model=p.model)
        else:  # the backend's own name for the model must not reach the client
            obj["model"] = self._model
        choices = obj.get("choices") or []
        if self._chat and not self._opened and choices and p.events:
            self._opened = True
            delta = choices[0].get("delta") or {}
            delta.pop("role", None)
            if not delta.get("content") and not choices[0].get("finish_reason"):
                return b""  # the opening chunk: the client had its own
        usage = obj.get("usage")
        if isinstance(usage, dict):
            return self._usage(obj, usage)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _usage(self, obj: dict[str, Any], usage: dict[str, Any]) -> bytes:
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - self._given)
        completion = int(usage.get("completion_tokens") or 0) + self._partial.tokens
        self.usage = (prompt, completion)
        if self._strip and not obj.get("choices"):
            return b""
        usage.update(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
        return b"data: " + orjson.dumps(obj) + b"\n\n"
