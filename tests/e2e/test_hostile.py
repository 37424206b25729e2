"""Hostile clients and broken backends at the front door: bodies declared too large, more
bytes than the process may hold, forged forwarding headers and log lines, wrong keys, and a
backend whose bytes or credentials must never reach a client."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, free_port, wait_for

KEY, ADMIN = "client-key-123", "admin-key-456"
SECRET = "pa55word-in-url"
BROKEN = ("garbage-model", "reset-model", "headers-model")


def raw(gw: Gateway, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


class Garbage:
    """A backend that passes its health checks (serving ``garbage-model``) and answers every
    completion with a malformed status line."""

    def __init__(self) -> None:
        self.port = free_port()
        self._sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                if request.startswith(b"GET "):
                    body = json.dumps({"object": "list", "data": [
                        {"id": m, "object": "model"} for m in BROKEN]}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
                elif b"reset-model" in request:  # a reset: close with unread data, linger 0
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
                elif b"headers-model" in request:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nRAW-BACKEND-BYTES no colon\r\n\r\n")
                else:
                    conn.sendall(b"HTTP/1.1 2OO RAW-BACKEND-BYTES\r\nX: y\r\n\r\n")

    def stop(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    backend = Sim(tmp, "h")
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def garbage() -> Iterator[Garbage]:
    backend = Garbage()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def gw(tmp: Path, sim: Sim, garbage: Garbage) -> Iterator[Gateway]:
    creds = sim.url.replace("http://", f"http://user:{SECRET}@")
    config = (f'api_keys = ["{KEY}"]\nadmin_key = "{ADMIN}"\nlog_format = "text"\n'
              "max_buffered_bytes = 1048576\npublic_metrics = false\n"
              'media_urls = "deny_private"\n'
              "[health]\ninterval = 0.3\n" + backend_toml("a", creds)
              + backend_toml("g", f"http://127.0.0.1:{garbage.port}"))
    gateway = Gateway(tmp, config, name="hostile")
    ready = {"authorization": f"Bearer {ADMIN}"}
    wait_for(lambda: all(s == "ready" for s in httpx.get(
        gateway.url + "/readyz", headers=ready).json()["backends"].values()), 20, "both ready")
    yield gateway
    gateway.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(gw: Gateway, model: str = "sim-model", **headers: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", headers={**auth(), **headers}, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        timeout=10)


def test_a_declared_body_over_the_limit_is_413_at_once_and_closed(gw: Gateway) -> None:
    reply = raw(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode() + b"\r\nContent-Length: 52428800\r\n\r\n")  # and no body
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_more_bytes_than_the_process_may_hold_is_503_with_retry_after(gw: Gateway) -> None:
    reply = raw(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode() + b"\r\nConnection: close\r\nContent-Length: 2000000\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == "overloaded"
    assert chat(gw).status_code == 200  # the bytes taken were given back


def test_chunked_bodies_are_given_back_too(gw: Gateway) -> None:
    body = json.dumps({"model": "sim-model", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x" * 300_000}]}).encode()
    for _ in range(6):  # 1.8 MB in all through a 1 MiB budget: each given back after use
        reply = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                           headers={**auth(), "content-type": "application/json"},
                           content=iter([body[:1000], body[1000:]]))  # no length: chunked
        assert reply.status_code == 200, reply.text


def test_a_forged_forwarding_chain_is_not_believed(gw: Gateway) -> None:
    reply = chat(gw, **{"x-forwarded-for": "6.6.6.6", "x-real-ip": "6.6.6.6"})
    rid = reply.headers["x-request-id"]
    line = wait_for(lambda: next((ln for ln in gw.proc.output().splitlines()
                                  if f"id={rid}" in ln), None), 10, "the access line")
    assert "client=127.0.0.1" in line and "6.6.6.6" not in line


def test_a_newline_in_a_client_value_cannot_forge_a_log_line(gw: Gateway) -> None:
    # Path, request id, session key and user agent, on a request refused for its key (the
    # refusal's log line names the path); then the model, on the access line.
    reply = raw(gw, b"POST /v1/chat%0D%0AFORGED2%1B[31m HTTP/1.1\r\nHost: x\r\n"
                b"Connection: close\r\nAuthorization: Bearer nope\r\n"
                b"X-Request-ID: id%0aFORGED4\r\nContent-Length: 2\r\n\r\n{}")
    assert reply.startswith(b"HTTP/1.1 401 ")
    wait_for(lambda: "/v1/chat\\r\\nFORGED2\\x1b[31m" in gw.proc.output(), 10,
             "the refusal's line, escaped")
    # Raw control characters in a header (user agent, request id, session key) are refused
    # by the parser, in the OpenAI error format, before anything is logged.
    for name in (b"User-Agent", b"X-Request-ID", b"X-Session-ID"):
        reply = raw(gw, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + name
                    + b": v\x1b[31mFORGED3\r\n\r\n")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), reply[:100]
        assert json.loads(body)["error"]["code"] == "malformed_request"
    forged = "m\n2026-12-04 00:00:00,000 INFO 1 gateway.access: FORGED\x1b[31m"
    assert chat(gw, model=forged).status_code == 404
    escaped = "\\n2026-12-04 00:00:00,000 INFO 1 gateway.access: FORGED\\x1b[31m"
    wait_for(lambda: escaped in gw.proc.output(), 10, "the access line, escaped")
    lines = gw.proc.output().splitlines()
    assert not any("FORGED" in ln and not ln[0:4].isdigit() for ln in lines)
    assert not any(ln.startswith("2026-12-04 00:00:00,000") for ln in lines)


def refusals(gw: Gateway) -> float:
    metrics = httpx.get(gw.url + "/metrics", headers=auth(ADMIN)).text
    found = re.search(r'gateway_auth_failures_total\{reason="invalid",route="api"\} (\S+)',
                      metrics)
    return float(found.group(1)) if found else 0.0


def test_wrong_keys_are_counted_and_logged_without_the_key(gw: Gateway) -> None:
    line = "api key invalid from 127.0.0.1 on /v1/chat/completions"
    before, logged, sent = refusals(gw), gw.proc.output().count(line), 0

    def refuse() -> bool:  # at most one line a second: until this second's line is written
        nonlocal sent
        assert chat(gw, authorization="Bearer wrong-key-789").status_code == 401
        sent += 1
        return gw.proc.output().count(line) > logged

    wait_for(refuse, 5, "a refusal's log line", every=0.1)
    assert httpx.get(gw.url + "/admin/status", headers=auth("bad-admin-key")).status_code == 401
    output = gw.proc.output()
    assert "wrong-key-789" not in output and "bad-admin-key" not in output
    assert refusals(gw) == before + sent  # every refusal counted, logged or not


def test_metrics_dashboard_and_readiness_detail_need_the_admin_key(gw: Gateway) -> None:
    assert httpx.get(gw.url + "/metrics").status_code == 401
    assert httpx.get(gw.url + "/dashboard").status_code == 401
    assert httpx.get(gw.url + "/metrics", headers=auth(ADMIN)).status_code == 200
    ready = httpx.get(gw.url + "/readyz").json()
    assert "backends" not in ready and ready["ready"] is True
    assert "backends" in httpx.get(gw.url + "/readyz", headers=auth(ADMIN)).json()


@pytest.mark.parametrize("model", BROKEN)
def test_a_backends_broken_bytes_and_address_stay_in_the_log(gw: Gateway, garbage: Garbage,
                                                             model: str) -> None:
    reply = chat(gw, model=model, **{"x-request-id": f"broken-{model}"})
    assert reply.status_code == 502
    body = reply.text
    assert "RAW-BACKEND-BYTES" not in body and str(garbage.port) not in body
    assert "127.0.0.1" not in body and reply.json()["error"]["message"]
    output = gw.proc.output()
    assert f"broken-{model}" in output and "failed before its response headers" in output


def test_url_credentials_are_never_shown(gw: Gateway) -> None:
    status = httpx.get(gw.url + "/admin/status", headers=auth(ADMIN)).json()
    url = next(b["url"] for b in status["backends"] if b["name"] == "a")
    assert url.startswith("http://***@127.0.0.1:")
    data = httpx.get(gw.url + "/dashboard/data", headers=auth(ADMIN)).text
    assert SECRET not in data and "***@127.0.0.1" in data
    assert SECRET not in gw.proc.output()
    assert SECRET not in httpx.get(gw.url + "/metrics", headers=auth(ADMIN)).text


def test_a_media_url_into_the_private_network_is_refused_naming_the_field(gw: Gateway) -> None:
    def ask(url: str) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", headers=auth(), timeout=10, json={
            "model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url}}]}]})

    metadata = ask("http://169.254.169.254/latest/meta-data/iam/")
    assert metadata.status_code == 400
    assert metadata.json()["error"]["param"] == "messages.0.content.1.image_url.url"
    assert ask("file:///etc/passwd").status_code == 400
    assert ask("data:image/png;base64,iVBORw0KGgo=").status_code == 200  # inline: passes
