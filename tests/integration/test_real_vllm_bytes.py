"""What the gateway does to reply bytes, against real vLLM: model aliases (chat and
completions, streamed and not), HTTP/1.0 framing, a reload that re-maps ``[[models]]``, and
a cached reply replayed when no backend can answer. Every gateway here runs the default
configuration (embedded Redis, sticky routing, reply cache, shared breakers) with the two
instances of the package fixture ``gw`` as url backends."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, backend_toml, http_ok, wait_for
from tests.integration.vllm_setup import STARTUP, status

pytestmark = pytest.mark.timeout(STARTUP + 300)

MESSAGES = [{"role": "user", "content": "hello"}]


def start(gw: Gateway, tmp: Path, name: str, models: str) -> Gateway:
    backends = "".join(backend_toml(b, s["url"]) for b, s in sorted(status(gw).items()))
    gateway = Gateway(tmp, "[health]\ninterval = 0.5\n" + backends + models, name=name)
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 30, f"{name} ready")
    return gateway


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


ALIASES = ('[[models]]\nname = "llama"\ngroups = { stable = "tiny-llama" }\n'
           '[[models]]\nname = "later"\ngroups = { stable = "not-served-yet" }\n')


@pytest.fixture(scope="module")
def alias(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start(gw, tmp_path_factory.mktemp("alias"), "alias", ALIASES)
    yield gateway
    gateway.stop()


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_shorter_alias_gives_whole_non_streaming_replies(alias: Gateway, route: str) -> None:
    client = sdk(alias)
    if route == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model="llama", messages=MESSAGES, max_tokens=8)
    else:
        raw = client.completions.with_raw_response.create(
            model="llama", prompt="hello", max_tokens=8)
    reply = raw.parse()  # the SDK raised APIConnectionError here when the length was kept
    assert reply.model == "llama"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert int(raw.headers["content-length"]) == len(raw.content)
    assert b"tiny-llama" not in raw.content


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_alias_is_rewritten_in_every_event_of_a_stream(alias: Gateway, route: str) -> None:
    client = sdk(alias)
    if route == "chat":
        chunks = list(client.chat.completions.create(
            model="llama", messages=MESSAGES, max_tokens=8, stream=True,
            stream_options={"include_usage": True}))
    else:
        chunks = list(client.completions.create(
            model="llama", prompt="hello", max_tokens=8, stream=True,
            stream_options={"include_usage": True}))
    assert len(chunks) >= 2  # text and usage: vLLM may send several tokens in one event
    assert {c.model for c in chunks} == {"llama"}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_an_http10_client_gets_a_stream_whole_with_its_length(alias: Gateway) -> None:
    body = json.dumps({"model": "llama", "messages": MESSAGES, "max_tokens": 4,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", alias.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    head = head.lower()
    assert b"transfer-encoding" not in head
    assert f"content-length: {len(payload)}".encode() in head
    assert payload.endswith(b"data: [DONE]\n\n") and b'"model":"llama"' in payload


def test_a_reload_that_remaps_models_reaches_the_body_and_the_reply(alias: Gateway) -> None:
    client = sdk(alias)
    # Declared, but nothing serves it yet: a 503 to retry, not a 404 (issue 36).
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="later", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 503
    text = alias.config_path.read_text()
    alias.config_path.write_text(text.replace('"not-served-yet"', '"tiny-llama"'))
    alias.proc.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded by SIGHUP" in alias.proc.output(), 10, "the reload")
    # Before the fix, routing followed the new map but the body still named the old
    # served model, and vLLM answered 404.
    raw = client.chat.completions.with_raw_response.create(
        model="later", messages=MESSAGES, max_tokens=4)
    assert raw.parse().model == "later"
    chunks = list(client.chat.completions.create(
        model="later", messages=MESSAGES, max_tokens=4, stream=True))
    assert {c.model for c in chunks} == {"later"}


def test_a_cached_real_reply_is_replayed_when_no_backend_can_answer(
        gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = start(gw, tmp_path_factory.mktemp("cache"), "cache", ALIASES)
    try:
        client = sdk(cache)
        question = {"model": "llama", "messages": [{"role": "user", "content": "cache me"}],
                    "max_tokens": 8, "temperature": 0}
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**question, stream=True)
                           if c.choices)
        plain = client.chat.completions.create(**question, stream=False)
        assert plain.choices[0].message.content == streamed  # temperature 0
        for name in ("v1", "v2"):
            reply = httpx.post(f"{cache.url}/admin/backends/{name}/drain", json={}, timeout=60)
            assert reply.json()["drained"] is True

        def replayed() -> openai.types.chat.ChatCompletion | None:
            raw = client.chat.completions.with_raw_response.create(**question)
            return raw.parse() if raw.headers.get("x-gateway-degraded") == "cache" else None

        again = wait_for(replayed, 10, "the reply cache to answer")
        assert again.model == "llama"
        assert again.choices[0].message.content == streamed
        chunks = list(client.chat.completions.create(**question, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == streamed
        assert {c.model for c in chunks} == {"llama"}
    finally:
        cache.stop()
