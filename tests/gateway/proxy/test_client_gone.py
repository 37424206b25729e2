"""A client that closes as soon as it reads a stream's last event (the OpenAI SDKs stop at
``data: [DONE]`` and close the connection before the reply's own end arrives): the usage
it was sent is still counted, as vLLM did the work."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.fakes import FakeUpstream, Reply, always
from tests.gateway.proxy.test_proxy import A, B, gateway

SSE = [(b"content-type", b"text/event-stream")]
USAGE = {"prompt_tokens": 13, "completion_tokens": 6, "total_tokens": 19}


def events() -> list[bytes]:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return [b"data: " + orjson.dumps({**chunk, "choices": [
                {"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}) + b"\n\n",
            b"data: " + orjson.dumps({**chunk, "choices": [], "usage": USAGE}) + b"\n\n",
            b"data: [DONE]\n\n"]


def test_usage_the_client_read_counts_though_it_closed_before_the_end() -> None:
    stream = always(Reply(200, list(SSE), events(), hang=True))  # its end never comes
    parts = gateway(FakeUpstream({A: stream, B: stream}))
    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})

    async def main() -> None:
        done, first = asyncio.Event(), True

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if b"[DONE]" in message.get("body", b""):
                done.set()  # read the last event: closes

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080),
                 "headers": [(b"host", b"gw"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        await asyncio.wait_for(parts.proxy(scope, receive, send), 10)
    asyncio.run(main())
    tokens = parts.metrics.registry.get_sample_value(
        "gateway_tokens_total", {"key": "anonymous", "model": "m", "kind": "completion"})
    assert tokens == 6
