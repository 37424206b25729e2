"""Pass-through and cancellation, proven with raw HTTP and from the backend's side."""

from __future__ import annotations

import json
import socket

import httpx

from tests.helpers import Gateway, Sim, wait_for

CHAT = "/v1/chat/completions"


def body(stream: bool, max_tokens: int = 2) -> dict[str, object]:
    return {"model": "sim-model", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]}


def test_each_chunk_reaches_the_client_before_the_next_is_sent(
    gateway: Gateway, sims: tuple[Sim, Sim],
) -> None:
    # The simulator sends the role chunk and tok0 at once, then waits 2 s before each of
    # the next tokens. What the client holds at each step must be all that was sent.
    with httpx.stream("POST", gateway.url + CHAT, json=body(True, 3),
                      headers={"x-sim": "itl=2"}, timeout=30) as resp:
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        sim = _backend_of(sims)
        done_before = sim.stats()["completed"]
        tokens = []
        for line in resp.iter_lines():
            if '"content":" tok' in line:
                tokens.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
                if len(tokens) < 3:  # the generation is still going: nothing was held back
                    assert sim.stats()["running"] >= 1
                    assert sim.stats()["completed"] == done_before
    assert tokens == [" tok0", " tok1", " tok2"]


def _raw_request(gw: Gateway, payload: dict[str, object], extra: str = "") -> socket.socket:
    data = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}\r\n")
    sock.sendall(head.encode() + data)
    return sock


def _backend_of(sims: tuple[Sim, Sim]) -> Sim:
    return wait_for(lambda: next((s for s in sims if s.stats()["running"] == 1), None), 5,
                    "the request to reach a simulator")


def test_disconnect_mid_stream_cancels_upstream(gateway: Gateway, sims: tuple[Sim, Sim]) -> None:
    before = {s.url: s.stats()["cancelled"] for s in sims}
    completed = sum(s.stats()["completed"] for s in sims)
    sock = _raw_request(gateway, body(True, 1000), "x-sim: itl=0.05\r\n")
    assert b"tok0" in _read_until(sock, b"tok0")
    sim = _backend_of(sims)
    sock.close()
    # 1,000 tokens 50 ms apart would take 50 s: cancelled well before, not at the end.
    wait_for(lambda: sim.stats()["cancelled"] == before[sim.url] + 1, 10,
             "the backend to see its request cancelled")
    assert sim.stats()["running"] == 0
    assert sum(s.stats()["completed"] for s in sims) == completed  # it never finished


def test_disconnect_while_waiting_for_headers_cancels_upstream(
    gateway: Gateway, sims: tuple[Sim, Sim]
) -> None:
    before = {s.url: s.stats()["cancelled"] for s in sims}
    # stream=false with a 60 s generation: the gateway is waiting for response headers.
    sock = _raw_request(gateway, body(False, 10), "x-sim: ttft=60\r\n")
    sim = _backend_of(sims)
    sock.close()
    wait_for(lambda: sim.stats()["cancelled"] == before[sim.url] + 1, 10,
             "the backend to see its request cancelled")
    assert sim.stats()["running"] == 0


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    sock.settimeout(5)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
