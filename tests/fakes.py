"""In-memory stand-ins for the gateway's I/O, to drive its core without sockets or
processes: an upstream HTTP client whose backends are Python functions, and an ASGI
client that calls the proxy directly. ``tests/gateway/upstream/test_contract.py`` holds the
fake upstream to what the real client does with the same replies."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.upstream import ConnectFailed, UpstreamBroken
from gateway.upstream.base import Headers

JSON = [(b"content-type", b"application/json")]


@dataclass
class Reply:
    """What a fake backend answers: a status, headers, and the body in the chunks it comes
    in (``cut``: the connection breaks after them instead of ending)."""

    status: int = 200
    headers: Headers = field(default_factory=lambda: list(JSON))
    chunks: list[bytes] = field(default_factory=list)
    cut: bool = False
    hang: bool = False  # after the chunks, nothing more: neither an end nor a break

    @classmethod
    def json(cls, status: int, body: dict[str, Any]) -> Reply:
        data = orjson.dumps(body)
        return cls(status, [*JSON, (b"content-length", str(len(data)).encode())], [data])


def completion(content: str = "ok", model: str = "m") -> Reply:
    """A chat completion as vLLM sends it (compact JSON, Content-Length)."""
    return Reply.json(200, {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


Answer = Callable[[bytes], Awaitable[Reply]]  # the request body -> the reply (or raises)


class FakeResponse:
    def __init__(self, reply: Reply) -> None:
        self.status = reply.status
        self.headers = list(reply.headers)
        self._chunks = list(reply.chunks)
        self._cut = reply.cut
        self._hang = reply.hang
        self.closed: bool | None = None  # reuse=..., once closed

    async def read(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._cut:
            raise UpstreamBroken("connection lost mid-reply")
        if self._hang:
            await asyncio.Event().wait()
        return b""

    async def aclose(self, reuse: bool) -> None:
        self.closed = reuse


class FakeUpstream:
    """Backends by base URL, each an async function of the request body; a URL with none
    refuses the connection. ``sent`` lists (url, body) in the order requests were made."""

    def __init__(self, backends: dict[str, Answer] | None = None,
                 tokenizers: dict[str, Answer] | None = None) -> None:
        self.backends = dict(backends or {})
        self.tokenizers = dict(tokenizers or {})  # vLLM's /tokenize, by base URL
        self.sent: list[tuple[str, bytes]] = []

    async def request(self, method: str, url: str, headers: Headers,
                      body: bytes) -> FakeResponse:
        if url.endswith("/tokenize"):
            base = url.removesuffix("/tokenize")
            answer = self.tokenizers.get(base)
            if answer is None:
                raise ConnectFailed(f"no tokenizer: {base}")
            return FakeResponse(await answer(body))
        base = url.split("/v1/", 1)[0]
        answer = self.backends.get(base)
        if answer is None:
            raise ConnectFailed(f"connection refused: {base}")
        self.sent.append((url, body))
        return FakeResponse(await answer(body))

    async def aclose(self) -> None:
        pass


def always(reply: Reply) -> Answer:
    async def answer(body: bytes) -> Reply:
        return reply
    return answer


def held(reply: Reply, release: asyncio.Event) -> Answer:
    """``reply`` once ``release`` is set."""
    async def answer(body: bytes) -> Reply:
        await release.wait()
        return reply
    return answer


@dataclass
class Answered:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


async def call(app: Callable[..., Awaitable[None]], payload: dict[str, Any],
               path: str = "/v1/chat/completions", headers: Headers = ()) -> Answered:
    """POST ``payload`` to the ASGI ``app`` as a client would, and what it answered."""
    body = orjson.dumps(payload)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8080),
             "headers": [(b"host", b"gw"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers]}
    sent: list[dict[str, Any]] = []
    first = True
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client stays until the reply is whole
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return Answered(start["status"],
                    {k.decode(): v.decode() for k, v in start.get("headers", [])},
                    b"".join(m.get("body", b"") for m in sent
                             if m["type"] == "http.response.body"))
