"""The gateway's own deadlines: a client's slow body (408) and the whole request's bound
(``upstream.total_timeout``), each against a simulator that would otherwise go on."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    s = Sim(tmp, "timeouts")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(tmp: Path, sim: Sim) -> Iterator[Gateway]:
    # The phases' own limits are far away: only body_timeout and total_timeout can fire.
    config = ("body_timeout = 0.5\n[upstream]\ntotal_timeout = 1.5\nfirst_byte_timeout = 600\n"
              "idle_timeout = 600\n[health]\ninterval = 0.5\n" + backend_toml("s", sim.url))
    g = Gateway(tmp, config, name="timeouts")
    wait_for(lambda: http_ok(g.url + "/readyz"), 10, "gateway ready")
    yield g
    g.stop()


def test_a_body_that_never_finishes_gets_408_and_never_reaches_a_backend(
    gw: Gateway, sim: Sim,
) -> None:
    before = sim.stats()["requests"]
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 200\r\n\r\n".encode() + b'{"model": "sim-')
        sock.settimeout(20)  # a bound for a broken gateway, not a measurement
        reply = b""
        while b"\r\n\r\n" not in reply or b"}}" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b'"code":"request_timeout"' in reply and b"0.5 s" in reply
    assert sim.stats()["requests"] == before


def test_total_timeout_ends_a_stream_that_is_still_going(gw: Gateway, sim: Sim) -> None:
    before = sim.stats()["cancelled"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    got: list[str] = []
    with pytest.raises(openai.APIError, match="stalled mid-stream"):
        # 40 tokens, 0.1 s apart: 4 s of generation with every gap far below idle_timeout.
        for chunk in client.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=40, stream=True,  # type: ignore[arg-type]
                extra_headers={"x-sim": "itl=0.1"}, timeout=60):
            got.extend(c.delta.content or "" for c in chunk.choices)
    assert 1 <= len([t for t in got if t]) < 40
    wait_for(lambda: sim.stats()["cancelled"] == before + 1, 5, "the upstream to be closed")
    assert metric(gw.url, "gateway_stream_failures_total", cause="stalled") == 1


def test_total_timeout_bounds_the_wait_for_headers_too(gw: Gateway, sim: Sim) -> None:
    before = sim.stats()["cancelled"]
    reply = httpx.post(gw.url + CHAT, json={"model": "sim-model", "messages": MESSAGES},
                       headers={"x-sim": "ttft=30"}, timeout=60)
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "upstream_timeout"
    wait_for(lambda: sim.stats()["cancelled"] == before + 1, 5, "the upstream to be closed")
