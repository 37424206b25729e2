"""A batch input file's lines, as OpenAI's Batch API takes them: one JSON object per line,
``custom_id`` (a string, unique in the file), ``method`` ``POST``, ``url`` one of the
routes a batch may call, ``body`` an object. Read in a worker thread (file I/O), never
on the event loop; the first bad line is named."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_CUSTOM_ID = 512  # characters: a longer custom_id is refused


class BadLine(ValueError):
    """The file is not a batch input: ``line`` (1-based) says where, ``str`` what."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Checked:
    lines: int
    routes: tuple[str, ...]  # the routes its lines call


def parse(number: int, raw: bytes) -> Line:
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadLine(number, "not a JSON object") from None
    if not isinstance(item, dict):
        raise BadLine(number, "not a JSON object")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise BadLine(number, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if method != "POST":
        raise BadLine(number, "method must be POST")
    if url not in ROUTES:
        raise BadLine(number, "url must be one of " + ", ".join(ROUTES))
    if not isinstance(body, dict):
        raise BadLine(number, "body must be a JSON object")
    if body.get("stream"):
        raise BadLine(number, "a batch line cannot stream")
    return Line(number, custom_id, url, body)


def read(source: Iterable[bytes]) -> Iterator[Line]:
    """Each non-blank line of ``source``, parsed (BadLine at the first bad one)."""
    for number, raw in enumerate(source, 1):
        if raw.strip():
            yield parse(number, raw)


def check(source: Iterable[bytes], max_lines: int) -> Checked:
    """The whole file: every line good, ``custom_id`` unique, at most ``max_lines``."""
    seen: set[str] = set()
    routes: set[str] = set()
    for line in read(source):
        if line.custom_id in seen:
            raise BadLine(line.number, f"custom_id {line.custom_id[:100]!r} is repeated")
        if len(seen) >= max_lines:
            raise BadLine(line.number, f"a batch holds at most {max_lines} lines")
        seen.add(line.custom_id)
        routes.add(line.url)
    if not seen:
        raise BadLine(0, "the file has no lines")
    return Checked(len(seen), tuple(sorted(routes)))
