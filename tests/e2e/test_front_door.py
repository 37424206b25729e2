"""The front door's own limits (gateway.http.server), in the default process model: header
deadline, header size cap, connection cap. Raw sockets, because no client library sends
headers this slowly or this large on purpose."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, free_port, http_ok, wait_for

DEADLINE = 1.0
IDLE = 2.0


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    backend = Sim(tmp, "fd")
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def gw(tmp: Path, sim: Sim) -> Iterator[Gateway]:
    gateway = Gateway(tmp, f"header_timeout = {DEADLINE}\nmax_header_bytes = 8192\n"
                      f"keep_alive_timeout = {IDLE}\n"
                      + backend_toml("a", sim.url), name="front", workers=None)
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 20, "gateway ready")
    yield gateway
    gateway.stop()


def connect(gw: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_client_that_sends_nothing_is_closed_at_the_deadline(gw: Gateway) -> None:
    socks = [connect(gw) for _ in range(50)]
    start = time.monotonic()
    assert all(read_all(s) == b"" for s in socks)  # closed, nothing said
    assert time.monotonic() - start < DEADLINE + 5


def test_500_slow_header_clients_get_a_408_while_others_are_served(gw: Gateway) -> None:
    slow = [connect(gw) for _ in range(500)]
    for s in slow:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
    start = time.monotonic()
    took = []
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=gw.url, timeout=10) as client:  # meanwhile, legitimate ones
        for _ in range(50):
            t0 = time.monotonic()
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            took.append(time.monotonic() - t0)
    for s in slow:
        reply = read_all(s)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < DEADLINE + 10  # all closed at the deadline, not later
    assert sorted(took)[-1] < 2.0  # a generous bound: held sockets cost the others nothing


def test_a_huge_header_is_431_and_never_reaches_the_backend(gw: Gateway, sim: Sim) -> None:
    before = sim.stats()["completed"]
    sock = connect(gw)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\nX-Big: ")

    def send() -> None:
        try:
            sock.sendall(head + b"a" * (8 * 1024 * 1024) + b"\r\n\r\n{}")
        except OSError:
            pass  # the gateway stopped reading: expected

    sender = threading.Thread(target=send)
    sender.start()
    reply = read_all(sock)
    sender.join(10)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    assert sim.stats()["completed"] == before
    assert httpx.get(gw.url + "/healthz").status_code == 200


def one_reply(sock: socket.socket) -> bytes:
    """One whole reply with a Content-Length from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_a_kept_alive_connection_is_closed_after_the_idle_timeout(gw: Gateway) -> None:
    sock = connect(gw)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    sock.sendall(request)
    assert one_reply(sock).startswith(b"HTTP/1.1 200 ")
    time.sleep(DEADLINE * 1.5)  # idle past the header deadline, within the idle timeout
    sock.sendall(request)  # kept alive: the header deadline runs only once a request starts
    assert one_reply(sock).startswith(b"HTTP/1.1 200 ")
    start = time.monotonic()
    assert read_all(sock) == b""  # then closed by the gateway, idle
    assert IDLE - 0.5 < time.monotonic() - start < IDLE + 5


def test_headers_within_the_cap_and_a_large_body_pass(gw: Gateway) -> None:
    body = {"model": "sim-model", "max_tokens": 1,
            "messages": [{"role": "user", "content": "x" * 500_000}]}
    reply = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"x-filler": "y" * 6000})
    assert reply.status_code == 200, reply.text


def test_a_client_still_uploading_reads_its_413(gw: Gateway) -> None:
    """An honest Content-Length of 50 MB (limit 16 MiB), sent at once by a client that
    writes its whole request before it reads: the 413 comes before the body is read, and the
    gateway reads and drops the rest before it closes, so the upload ends and the client
    reads the 413 (a close with unread data resets the upload, and many clients then never
    read the answer)."""
    size, piece = 50_000_000, b"x" * 65536
    for _ in range(3):
        sock = connect(gw)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % size)
        for start in range(0, size, len(piece)):
            sock.sendall(piece[:size - start])  # a reset would raise here
        reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 413 "), reply[:80]
        assert b"connection: close" in reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
            "payload_too_large"


def test_a_body_left_unread_by_an_early_answer_is_not_the_next_requests_headers(
        gw: Gateway) -> None:
    """A POST answered before its body was read (here a 404): the body that follows is
    dropped as body, not counted against the next request's header cap (8 KiB here: it was
    a 431 on a kept-alive connection), and the connection serves its next request."""
    sock = connect(gw)
    size = 200_000
    sock.sendall(b"POST /v1/no-such-route HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n" % size)
    assert one_reply(sock).startswith(b"HTTP/1.1 404 ")
    sock.sendall(b"x" * size)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert one_reply(sock).startswith(b"HTTP/1.1 200 ")
    sock.close()


def test_after_an_unread_body_the_next_requests_headers_have_their_deadline(
        gw: Gateway) -> None:
    """The end of a body nobody read and the start of the next request in one write,
    then silence: the next request's header deadline holds, and an idle connection's
    keep-alive timeout."""
    sock = connect(gw)
    sock.sendall(b"POST /v1/no-such-route HTTP/1.1\r\nHost: x\r\ncontent-length: 20000"
                 b"\r\n\r\n")
    assert one_reply(sock).startswith(b"HTTP/1.1 404 ")
    sock.sendall(b"x" * 20000 + b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    start = time.monotonic()
    reply = read_all(sock)  # closed at the deadline (its header bytes came uncounted)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408 "), reply[:80]
    assert time.monotonic() - start < DEADLINE + 5
    idle = connect(gw)
    idle.sendall(b"POST /v1/no-such-route HTTP/1.1\r\nHost: x\r\ncontent-length: 20000"
                 b"\r\n\r\n")
    assert one_reply(idle).startswith(b"HTTP/1.1 404 ")
    idle.sendall(b"x" * 20000)  # then nothing more: closed once idle for the keep-alive
    start = time.monotonic()
    assert read_all(idle) == b""
    assert time.monotonic() - start < IDLE + 5


def test_a_body_left_unread_that_never_ends_closes_the_connection(gw: Gateway) -> None:
    sock = connect(gw)
    sock.sendall(b"POST /v1/no-such-route HTTP/1.1\r\nHost: x\r\ncontent-length: 1000"
                 b"\r\n\r\nxx")
    assert one_reply(sock).startswith(b"HTTP/1.1 404 ")
    start = time.monotonic()
    assert read_all(sock) == b""  # closed at the header deadline, not held forever
    assert time.monotonic() - start < DEADLINE + 5


def capped(tmp: Path, sim: Sim) -> Gateway:
    gw = Gateway(tmp, "max_connections = 8\nheader_timeout = 30\n" + backend_toml("a", sim.url),
                 name="capped")
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "capped gateway ready")
    return gw


def counted(gw: Gateway, name: str) -> float:
    metrics = httpx.get(gw.url + "/metrics").text
    return float(next(ln for ln in metrics.splitlines() if ln.startswith(name + " ")).split()[1])


def test_a_new_connection_past_the_cap_closes_the_oldest_idle_one(tmp: Path, sim: Sim) -> None:
    gw = capped(tmp, sim)
    try:
        idle = [connect(gw) for _ in range(8)]  # connected, nothing sent
        wait_for(lambda: counted(gw, "gateway_connections_evicted_total") >= 1, 10,
                 "the cap reached (each probe closes the oldest idle connection)")
        body = {"model": "sim-model", "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}]}
        for _ in range(3):
            reply = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
            assert reply.status_code == 200, reply.text
        assert read_all(idle[0]) == b""  # the oldest was closed, having lost nothing
        assert "idle connection closed to make room" in gw.proc.output()
    finally:
        gw.stop()


def test_connections_over_the_cap_get_a_503_not_a_silent_reset(tmp: Path, sim: Sim) -> None:
    """Eight connections busy sending their headers, none idle: a ninth gets the 503 even
    when its request is already waiting in the socket as the gateway accepts it (the
    gateway is stopped while it connects and sends), which a plain close would reset."""
    gw = capped(tmp, sim)
    try:
        busy = [connect(gw) for _ in range(8)]
        for s in busy:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        wait_for(lambda: "connection refused" in _try_one(gw), 10, "a refusal past the cap")
        for _ in range(3):
            os.kill(gw.proc.popen.pid, signal.SIGSTOP)
            try:
                waiting = connect(gw)  # the kernel completes the handshake meanwhile
                waiting.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            finally:
                os.kill(gw.proc.popen.pid, signal.SIGCONT)
            reply = read_all(waiting)
            assert reply.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in reply, reply
            code = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"]
            assert code == "too_many_connections"
        assert "connection refused: 8 open connections" in gw.proc.output()
        for s in busy:
            s.close()
        wait_for(lambda: http_ok(gw.url + "/healthz"), 10, "served again below the cap")
        assert counted(gw, "gateway_connections_refused_total") >= 4
    finally:
        gw.stop()


def serve_limited(tmp: Path, sim: Sim, name: str, limit: int) -> tuple[subprocess.Popen[bytes],
                                                                        int, Path]:
    """The gateway in its default process model under a descriptor limit of ``limit``."""
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(f'[gateway]\nlisten = "127.0.0.1:{port}"\n'
                      f'[redis]\ndata_dir = "{tmp / f"{name}-valkey"}"\n'
                      + backend_toml("a", sim.url))
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    return proc, port, log


def test_idle_connections_past_a_low_descriptor_limit_cost_a_request_nothing(
    tmp: Path, sim: Sim,
) -> None:
    """The issue 36 case: 256 descriptors, the default process model, 296 connections that
    send nothing, then requests: each is answered (an idle connection makes room), none
    reset; the limit does not end the gateway either."""
    proc, port, log = serve_limited(tmp, sim, "fds", 256)
    url = f"http://127.0.0.1:{port}"
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    try:
        wait_for(lambda: http_ok(url + "/readyz"), 30, "gateway ready")
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(296)]

        def ask() -> int | str:
            try:
                return httpx.post(url + "/v1/chat/completions", json=body, timeout=5).status_code
            except httpx.TransportError as exc:  # a reset: what must not happen
                return repr(exc)

        # The idle ones younger than 0.1 s are not closed (a 503 meanwhile), then they are.
        replies = [ask() for _ in range(5)]
        assert set(replies) <= {200, 503}, replies
        wait_for(lambda: ask() == 200, 10, "an idle connection closed to make room")
        assert "idle connection closed to make room" in log.read_text()
        assert "Too many open files" not in log.read_text()
        for s in held:
            s.close()
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_descriptor_limit_too_low_to_serve_is_a_start_up_error(tmp: Path, sim: Sim) -> None:
    proc, _, log = serve_limited(tmp, sim, "fds-low", 100)
    try:
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert ("the open-files limit (RLIMIT_NOFILE) is 100: too low to serve; the gateway needs "
            "at least 128") in log.read_text()


def _try_one(gw: Gateway) -> str:
    with connect(gw) as sock:
        read_all(sock)
    return gw.proc.output()
