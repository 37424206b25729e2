"""What crosses the gateway in each direction, seen from the backend's side."""

from __future__ import annotations

import re

import httpx

from tests.helpers import Gateway, Sim

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
    assert re.fullmatch("[0-9a-f]{32}", unsafe.headers["x-request-id"])  # a fresh one
    assert unsafe.headers["x-request-id"] != plain.headers["x-request-id"]


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


def test_backend_4xx_passes_through_verbatim_and_is_tried_on_one_backend_only(
    gateway: Gateway, sims: tuple[Sim, Sim],
) -> None:
    # Both a and b serve sim-model and both answer this request with the same 400.
    asked = {**BODY, "model": "sim-model"}
    sim = {"x-sim": "max_prompt_len=2"}
    before = [s.stats()["requests"] for s in sims]
    resp = httpx.post(gateway.url + CHAT, json=asked, headers=sim)
    assert resp.status_code == 400
    assert [s.stats()["requests"] - b for s, b in zip(sims, before, strict=True)] in (
        [1, 0], [0, 1])  # never retried on the other backend
    answered = sims[0] if resp.headers["x-gateway-backend"] == "a" else sims[1]
    direct = httpx.post(answered.url + CHAT, json=asked, headers=sim)
    assert resp.content == direct.content  # byte for byte, the backend's own body
    assert resp.headers["content-type"] == direct.headers["content-type"]
    assert b"maximum context length" in resp.content
