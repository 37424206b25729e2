"""Pass-through end to end, byte for byte: what a backend writes (its framing, spacing,
cookies) is what the client reads, for a stream and for a whole reply."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, RawBackend, backend_toml, http_ok, wait_for

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
EVENTS = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"sim-model",'
          b'"choices":[{"index":0,"delta":{"content":" caf\xc3\xa9"}}]}\n\n'
          b'data: {"id":"c1", "object": "chat.completion.chunk", "model": "sim-model",'
          b' "choices":[{"index":0,"delta":{"content":" \\u00e9"},"finish_reason":"stop"}]}\n\n'
          b"data: [DONE]\n\n")
WHOLE = (b'{ "id": "c2", "object": "chat.completion", "model": "sim-model", "choices": '
         b'[{"index": 0, "message": {"role": "assistant", "content": "ok"}}] }')
COOKIE = b"AWSALB=node-7; Path=/; HttpOnly"


def answer(conn: socket.socket, body: bytes) -> None:
    if b'"stream":true' in body.replace(b" ", b""):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Set-Cookie: " + COOKIE + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        for cut in (EVENTS[:7], EVENTS[7:70], EVENTS[70:71], EVENTS[71:]):  # odd splits
            conn.sendall(b"%x\r\n%s\r\n" % (len(cut), cut))
        conn.sendall(b"0\r\n\r\n")
    else:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nSet-Cookie: "
                     + COOKIE + b"\r\nContent-Length: %d\r\n\r\n" % len(WHOLE) + WHOLE)


@pytest.fixture(scope="module")
def gw(tmp: Path) -> Iterator[Gateway]:
    raw = RawBackend(answer)
    g = Gateway(tmp, "[health]\ninterval = 0.3\n[degraded]\ncache = false\n"
                + backend_toml("raw", raw.url), name="passthrough")
    wait_for(lambda: http_ok(g.url + "/readyz"), 10, "gateway ready")
    yield g
    g.stop()
    raw.stop()


def test_a_stream_reaches_the_client_byte_for_byte_with_its_cookie(gw: Gateway) -> None:
    with httpx.stream("POST", gw.url + CHAT, json={**BODY, "stream": True}) as resp:
        received = b"".join(resp.iter_raw())
    assert resp.status_code == 200
    assert received == EVENTS
    assert resp.headers.get_list("set-cookie") == [COOKIE.decode()]


def test_a_whole_reply_reaches_the_client_byte_for_byte_with_its_cookie(gw: Gateway) -> None:
    resp = httpx.post(gw.url + CHAT, json=BODY)
    assert resp.status_code == 200
    assert resp.content == WHOLE
    assert resp.headers["content-length"] == str(len(WHOLE))
    assert resp.headers.get_list("set-cookie") == [COOKIE.decode()]
