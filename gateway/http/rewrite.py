"""Giving the client its own model name back in a reply that names the served one.

A group may serve a client's model under another name (``[[models]]``). Replies name the
served model in their ``"model"`` field; the client must see its own name there. The match
allows any JSON spacing (``"model":"x"``, ``"model" : "x"``, a newline between) because
not every OpenAI-compatible server writes compact JSON as vLLM does.

A whole body (a non-streaming reply) is rewritten at once, and its ``Content-Length`` is
the new length. A stream is rewritten line by line: an SSE ``data:`` line holds one JSON
object and never a raw newline, so a name can't span two lines, and the incomplete last
line of a chunk is held back until the rest of it arrives. The client therefore gets the
same bytes however the backend's chunks happen to be cut.
"""

from __future__ import annotations

import re
from typing import Protocol

import orjson


class Filter(Protocol):
    """What changes a reply's bytes on their way: a whole body, or a stream chunk by chunk
    (holding back what can't be judged yet); ``usage`` is what it saw of the reply's."""

    @property
    def usage(self) -> tuple[int, int] | None: ...

    def whole(self, body: bytes) -> bytes: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


def whole_events(carry: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """The complete SSE events in what was held back plus ``chunk``, and the incomplete
    rest to hold back for the next chunk (either may be b"")."""
    data = carry + chunk if carry else chunk
    cut = data.rfind(b"\n\n") + 2
    if cut < 2:
        return b"", data
    return data[:cut], data[cut:]


class ModelRewrite:
    __slots__ = ("_carry", "_new", "_pattern")

    usage: tuple[int, int] | None = None  # it reads no usage

    def __init__(self, served: str, model: str) -> None:
        self._pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(orjson.dumps(served)))
        self._new = orjson.dumps(model)
        self._carry = b""

    def _sub(self, data: bytes) -> bytes:
        return self._pattern.sub(self._replace, data)

    def _replace(self, match: re.Match[bytes]) -> bytes:
        return match.group(1) + self._new

    def whole(self, body: bytes) -> bytes:
        """A complete body, rewritten."""
        return self._sub(body)

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines so far, rewritten; the incomplete last line waits (may be b"")."""
        data = self._carry + chunk if self._carry else chunk
        cut = data.rfind(b"\n") + 1
        if cut == len(data):
            self._carry = b""
            return self._sub(data)
        self._carry = data[cut:]
        return self._sub(data[:cut]) if cut else b""

    def flush(self) -> bytes:
        """What is still held back when the stream ends."""
        rest, self._carry = self._carry, b""
        return self._sub(rest) if rest else b""


class Chain:
    """Two filters, one after the other."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: Filter, second: Filter) -> None:
        self._first, self._second = first, second

    @property
    def usage(self) -> tuple[int, int] | None:
        return self._second.usage or self._first.usage

    def whole(self, body: bytes) -> bytes:
        return self._second.whole(self._first.whole(body))

    def feed(self, chunk: bytes) -> bytes:
        return self._second.feed(self._first.feed(chunk))

    def flush(self) -> bytes:
        return self._second.feed(self._first.flush()) + self._second.flush()
