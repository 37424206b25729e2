"""Reply bytes the gateway changes: model aliases over any JSON spacing and any chunking,
the lengths that go with them, and HTTP/1.0 framing.

The backend here is a stub OpenAI-compatible server that writes *spaced* JSON (as servers
other than vLLM may), sends ``Content-Length`` on non-streaming replies (as vLLM does), and
cuts every SSE event into two writes in the middle of the model name.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from tests.helpers import Gateway, backend_toml, http_ok, wait_for

SERVED = {"served-name", "s"}
ALIASES = {"ll": "served-name", "a-much-longer-client-name": "s"}


def spaced(obj: object) -> bytes:
    return json.dumps(obj, separators=(", ", ": ")).encode()


async def chat(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    model = payload["model"]
    if model not in SERVED:
        return web.json_response({"object": "error", "message": "no such model", "code": 404},
                                 status=404)
    if not payload.get("stream"):
        body = spaced({"id": "c1", "object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello there"},
             "finish_reason": "stop"}]})
        return web.Response(body=body, content_type="application/json")  # sets Content-Length
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for word in ("hello", " there"):
        event = b"data: " + spaced({"id": "c1", "object": "chat.completion.chunk",
                                    "model": model, "choices": [
                                        {"index": 0, "delta": {"content": word},
                                         "finish_reason": None}]}) + b"\n\n"
        cut = event.index(model.encode()) + 1  # the name split across two writes
        await resp.write(event[:cut])
        await asyncio.sleep(0.01)
        await resp.write(event[cut:])
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "owned_by": "stub"} for m in sorted(SERVED)]})


async def health(request: web.Request) -> web.Response:
    return web.Response()


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def gw(tmp: Path, stub: str) -> Iterator[Gateway]:
    routes = "".join(f'[[models]]\nname = "{c}"\ngroups = {{ stable = "{s}" }}\n'
                     for c, s in ALIASES.items())
    gateway = Gateway(tmp, "[health]\ninterval = 0.5\n" + backend_toml("stub", stub) + routes,
                      name="reply-bytes")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 10, "gateway ready")
    yield gateway
    gateway.stop()


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_of_any_length_gives_a_whole_non_streaming_reply(gw: Gateway,
                                                                  alias: str) -> None:
    raw = sdk(gw).chat.completions.with_raw_response.create(model=alias, messages=MESSAGES)
    reply = raw.parse()
    assert reply.model == alias
    assert reply.choices[0].message.content == "hello there"
    assert int(raw.headers["content-length"]) == len(raw.content)
    assert b"\"" + ALIASES[alias].encode() + b"\"" not in raw.content


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_split_across_chunks_is_rewritten_in_a_stream(gw: Gateway, alias: str) -> None:
    chunks = list(sdk(gw).chat.completions.create(model=alias, messages=MESSAGES, stream=True))
    assert {c.model for c in chunks} == {alias}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hello there"
    raw = httpx.post(gw.url + "/v1/chat/completions",
                     json={"model": alias, "messages": MESSAGES, "stream": True}).content
    assert b'"served-name"' not in raw and b'"model": "s"' not in raw
    assert raw.endswith(b"data: [DONE]\n\n")


def http10(gw: Gateway, body: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):  # HTTP/1.0: the server closes when done
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return head.lower(), payload


@pytest.mark.parametrize("stream", [False, True])
def test_an_http10_client_never_gets_chunked_framing(gw: Gateway, stream: bool) -> None:
    body = json.dumps({"model": "ll", "messages": MESSAGES, "stream": stream}).encode()
    head, payload = http10(gw, body)
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"transfer-encoding" not in head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.startswith(b"content-length:"))
    assert length == len(payload)
    if stream:
        assert payload.endswith(b"data: [DONE]\n\n") and b'"model": "ll"' in payload
    else:
        assert json.loads(payload)["model"] == "ll"
