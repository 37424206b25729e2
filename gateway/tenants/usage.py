"""Tokens as vLLM counts them: the ``usage`` object at the end of a reply.

A non-streaming reply ends with its ``usage`` (chat, completions, embeddings, the Responses
API and Anthropic messages alike), a stream with a usage chunk when it was asked for
(``stream_options.include_usage``). Only the tail of a reply is read, once, when it ended:
nothing per chunk. When a client streams without asking for usage and the gateway is set to
``inject`` it, the gateway asks for it (``with_usage``) and takes that chunk out of the
stream again (``UsageStrip``), so the client gets the bytes it asked for.
"""

from __future__ import annotations

import re

from gateway.http.rewrite import whole_events

USAGE = b'"usage":{'
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
STREAMED = ("/v1/chat/completions", "/v1/completions")
_ASK = b',"stream_options":{"include_usage":true}}'
_USAGE_CHUNK = b'"choices":[],"usage":{'  # vLLM's usage chunk (compact JSON)


def usage_of(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last ``usage`` object in ``tail``, or None."""
    at = tail.rfind(USAGE)
    if at < 0:
        return None
    segment = tail[at:at + 512]
    prompt, completion = _PROMPT.search(segment), _COMPLETION.search(segment)
    if prompt is None:
        return None
    return int(prompt[1]), int(completion[1]) if completion is not None else 0


def cached_of(tail: bytes) -> int | None:
    """The prompt tokens vLLM found in its prefix cache (``usage.prompt_tokens_details.
    cached_tokens``, with ``--enable-prompt-tokens-details``), or None."""
    at = tail.rfind(USAGE)
    found = _CACHED.search(tail, at, at + 1024) if at >= 0 else None
    return int(found[1]) if found is not None else None


def with_usage(path: str, payload: dict[str, object], body: bytes) -> bytes | None:
    """The body of a stream that did not ask for usage, asking for it; None when it asked
    already (or set ``stream_options`` itself, which is left alone), or isn't a stream."""
    if (path not in STREAMED or payload.get("stream") is not True
            or "stream_options" in payload or not body.rstrip().endswith(b"}")):
        return None
    return body.rstrip()[:-1] + _ASK


class UsageStrip:
    """Takes the usage chunk the client did not ask for out of a stream, keeping what it
    said (``usage``). Works on whole SSE events: the incomplete last one waits."""

    __slots__ = ("_carry", "usage")

    def __init__(self) -> None:
        self._carry = b""
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> bytes:
        events, self._carry = whole_events(self._carry, chunk)
        return self._drop(events) if events else b""

    def _drop(self, events: bytes) -> bytes:
        at = events.find(_USAGE_CHUNK)
        if at < 0:
            return events
        before = events.rfind(b"\n\n", 0, at)
        start = before + 2 if before >= 0 else 0
        end = events.find(b"\n\n", at) + 2
        self.usage = usage_of(events[start:end])
        return events[:start] + events[end:]

    def flush(self) -> bytes:
        rest, self._carry = self._carry, b""
        return self._drop(rest) if rest else b""

    def whole(self, body: bytes) -> bytes:
        return body
