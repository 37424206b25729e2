"""Backends that break in ways the simulator doesn't: a connection dropped after the
request arrived but before any response header, and a non-streaming reply cut after its
headers. Both are stand-ins on real sockets (``RawBackend``)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, RawBackend, Sim, backend_toml, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {"model": "sim-model", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}
CUT = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 300\r\n\r\n"
       b'{"id":"chatcmpl-1","object":"chat.completion","model":"sim-model","choices":[')


def hang_up(conn: socket.socket, body: bytes) -> None:
    """Read the request, answer nothing, close."""


def cut_after_headers(conn: socket.socket, body: bytes) -> None:
    conn.sendall(CUT)  # 300 bytes announced, fewer sent, then the connection closes


def start(tmp: Path, name: str, *backends: tuple[str, str]) -> Gateway:
    config = ('[routing]\nsticky = false\npolicy = "round_robin"\n[health]\ninterval = 0.3\n'
              "rise = 1\n[degraded]\ncache = false\n"
              + "".join(backend_toml(n, url) for n, url in backends))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    wait_for(lambda: all(b["state"] == "ready" for b in httpx.get(
        gw.url + "/admin/status").json()["backends"]), 10, "every backend ready")
    return gw


def breaker(gw: Gateway, name: str) -> dict[str, Any]:
    backends = httpx.get(gw.url + "/admin/status").json()["backends"]
    found: dict[str, Any] = next(b["breaker"] for b in backends if b["name"] == name)
    return found


def test_a_backend_that_breaks_before_its_headers_is_a_502_and_is_not_retried(
    tmp_path: Path,
) -> None:
    raw, sim = RawBackend(hang_up), Sim(tmp_path, "beside-raw")
    gw = start(tmp_path, "hangup", ("raw", raw.url), ("sim", sim.url))
    try:
        before = sim.stats()["requests"]
        statuses = [httpx.post(gw.url + CHAT, json=BODY, timeout=30) for _ in range(6)]
        bad = [r for r in statuses if r.status_code == 502]
        assert bad and all(r.json()["error"]["code"] == "upstream_unavailable" for r in bad)
        assert [r.status_code for r in statuses].count(200) == 6 - len(bad)
        # Each request reached exactly one backend: the request may have been acted on,
        # so it is not sent again (a refused connection would be).
        assert raw.posts == len(bad)
        assert sim.stats()["requests"] - before == 6 - len(bad)
        assert breaker(gw, "raw")["failures"] == len(bad)
        assert metric(gw.url, "gateway_retries_total", reason="connect") == 0
    finally:
        gw.stop()
        sim.stop()
        raw.stop()


def test_a_reply_cut_after_its_headers_drops_the_client_and_counts_against_the_backend(
    tmp_path: Path,
) -> None:
    raw = RawBackend(cut_after_headers)
    gw = start(tmp_path, "cut", ("raw", raw.url))
    try:
        with pytest.raises(httpx.RemoteProtocolError):  # the client's connection dropped
            httpx.post(gw.url + CHAT, json=BODY, timeout=30)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            client.chat.completions.create(model="sim-model", messages=BODY["messages"])
        assert raw.posts == 2  # never retried: its headers had gone out
        assert breaker(gw, "raw")["failures"] == 2
        assert metric(gw.url, "gateway_stream_failures_total", cause="dropped") == 2
        assert gw.proc.output().count('"note":"stream dropped"') == 2
        assert http_ok(gw.url + "/healthz")
    finally:
        gw.stop()
        raw.stop()
