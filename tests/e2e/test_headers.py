"""What crosses the gateway in each direction, seen from the backend's side."""

from __future__ import annotations

import httpx
from helpers import Gateway, Sim

CHAT = "/v1/chat/completions"
BODY = {"model": "other-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


def test_request_headers_are_filtered_and_backend_key_replaces_client_key(
    gateway: Gateway, sims: tuple[Sim, Sim]
) -> None:
    _, b = sims  # other-model is served by b only, and b has an API key
    resp = httpx.post(gateway.url + CHAT, json=BODY, headers={
        "Authorization": "Bearer client-secret",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
        "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "Basic abc",
        "TE": "trailers",
        "X-Request-ID": "req-123",
        "X-Custom": "kept",
    })
    assert resp.status_code == 200
    seen = dict(b.stats()["last_headers"])
    assert seen["authorization"] == "Bearer backend-secret-b"
    for name in ("x-drop-me", "keep-alive", "proxy-authorization", "te"):
        assert name not in seen, name
    assert seen.get("connection", "keep-alive") == "keep-alive"  # the client's value is gone
    assert seen["x-request-id"] == "req-123"
    assert seen["x-custom"] == "kept"
    assert resp.headers["x-request-id"] == "req-123"
    assert resp.headers["x-gateway-backend"] == "b"


def test_backend_without_key_gets_no_authorization(gateway: Gateway, sims: tuple[Sim, Sim]) -> None:
    a, _ = sims
    for _ in range(4):  # least-loaded rotation reaches a within a few requests
        resp = httpx.post(gateway.url + CHAT, json={**BODY, "model": "sim-model"},
                          headers={"Authorization": "Bearer client-secret"})
        if resp.headers["x-gateway-backend"] == "a":
            break
    assert resp.headers["x-gateway-backend"] == "a"
    assert "authorization" not in dict(a.stats()["last_headers"])


def test_request_id_is_generated_when_absent_or_unsafe(gateway: Gateway) -> None:
    plain = httpx.post(gateway.url + CHAT, json=BODY)
    assert len(plain.headers["x-request-id"]) == 32
    unsafe = httpx.post(gateway.url + CHAT, json=BODY, headers={"X-Request-ID": "a b"})
    assert unsafe.headers["x-request-id"] != "a b"


def test_errors_carry_request_id_and_openai_shape(gateway: Gateway) -> None:
    resp = httpx.post(gateway.url + CHAT, content=b"{not json", headers={"X-Request-ID": "r1"})
    assert resp.status_code == 400
    assert resp.headers["x-request-id"] == "r1"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    missing = httpx.post(gateway.url + CHAT, json={"messages": []})
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]
    wrong_method = httpx.get(gateway.url + CHAT)
    assert wrong_method.status_code == 405


def test_backend_4xx_passes_through_verbatim(gateway: Gateway) -> None:
    resp = httpx.post(gateway.url + CHAT, json={**BODY, "model": "sim-model"},
                      headers={"x-sim": "max_prompt_len=2"})
    assert resp.status_code == 400
    assert "maximum context length" in resp.json()["error"]["message"]
    assert resp.headers["x-gateway-backend"] in ("a", "b")
