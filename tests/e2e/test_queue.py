"""The gateway's queue, through the real gateway against simulators: a backend at capacity
is never sent more, the held requests go in priority order and round robin across tenants,
the queue is bounded in length and in wait (503 with Retry-After), and a client that hangs
up leaves it at once."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, RawBackend, Sim, backend_toml, http_ok, metric, wait_for

KEYS = {"a": "tenant-a-secret", "b": "tenant-b-secret", "vip": "tenant-vip-secret"}
HOLD = "ttft=2.0"  # a request that keeps the only place busy for a while


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    server = Sim(tmp, "queue", "--ttft", "0.05")
    yield server
    server.stop()


def start(tmp: Path, name: str, sim: Sim, queue: str, capacity: int = 1) -> Gateway:
    keys = "".join(f'[[keys]]\nname = "{n}"\nkey = "{k}"\npriority = {5 if n == "vip" else 0}\n'
                   for n, k in KEYS.items())
    config = (keys + f"[queue]\n{queue}[health]\ninterval = 0.3\n"
              + backend_toml("a", sim.url, f"max_concurrent = {capacity}"))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, f"{name} ready")
    return gw


@pytest.fixture(scope="module")
def gateway(tmp: Path, sim: Sim) -> Iterator[Gateway]:
    gw = start(tmp, "queued", sim, "max_length = 3\nmax_wait = 20\n")
    yield gw
    gw.stop()


class Call(threading.Thread):
    """One chat request in the background; ``done`` records the order replies came."""

    def __init__(self, gw: Gateway, tenant: str, done: list[str], label: str = "",
                 sim: str = "", timeout: float = 30, session: str = "") -> None:
        super().__init__(daemon=True)
        self.args_ = (gw, tenant, done, label or tenant, sim, timeout, session)
        self.status = 0
        self.error = ""
        self.start()

    def run(self) -> None:
        gw, tenant, done, label, sim, timeout, session = self.args_
        headers = {"authorization": f"Bearer {KEYS[tenant]}", "x-sim": sim,
                   **({"x-session-id": session} if session else {})}
        try:
            reply = httpx.post(gw.url + "/v1/chat/completions", headers=headers, timeout=timeout,
                               json={"model": "sim-model", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})
            self.status = reply.status_code
            self.error = reply.text if reply.status_code != 200 else ""
            done.append(label)
        except httpx.TimeoutException:
            self.status = -1


def depth(gw: Gateway) -> float:
    return sum(metric(gw.url, "gateway_queue_depth", band=b) for b in ("0", "5"))


def queue_up(gw: Gateway, done: list[str], *labels: tuple[str, str]) -> list[Call]:
    """The holder first, then each (tenant, label) once the one before it is queued."""
    calls = [Call(gw, "a", done, "holder", HOLD)]
    wait_for(lambda: metric(gw.url, "gateway_in_flight", backend="a") == 1, 5, "holder in")
    for n, (tenant, label) in enumerate(labels, 1):
        calls.append(Call(gw, tenant, done, label))
        wait_for(lambda n=n: depth(gw) == n, 5, f"{label} queued")  # type: ignore[misc]
    return calls


def test_priority_bands_first_then_round_robin_across_tenants(
        gateway: Gateway, sim: Sim) -> None:
    done: list[str] = []
    calls = queue_up(gateway, done, ("a", "a1"), ("a", "a2"), ("b", "b1"))
    for call in calls:
        call.join(30)
    # One at a time (capacity 1): b1 before a2, though a2 waited longer (round robin).
    assert done == ["holder", "a1", "b1", "a2"]
    assert all(c.status == 200 for c in calls)
    assert sim.stats()["peak"] == 1
    done.clear()
    calls = queue_up(gateway, done, ("a", "a1"), ("b", "b1"), ("vip", "vip"))
    for call in calls:
        call.join(30)
    assert done == ["holder", "vip", "a1", "b1"]  # the higher band first


def test_a_full_queue_answers_503_at_once(gateway: Gateway) -> None:
    done: list[str] = []
    calls = queue_up(gateway, done, ("a", "a1"), ("a", "a2"), ("b", "b1"))
    refused = httpx.post(gateway.url + "/v1/chat/completions", timeout=5,
                         headers={"authorization": f"Bearer {KEYS['b']}"},
                         json={"model": "sim-model", "messages": [{"role": "user",
                                                                   "content": "hi"}]})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    for call in calls:
        call.join(30)
    assert [c.status for c in calls] == [200] * 4
    assert metric(gateway.url, "gateway_shed_total", reason="full") >= 1


def test_a_client_that_hangs_up_leaves_the_queue(gateway: Gateway) -> None:
    done: list[str] = []
    calls = queue_up(gateway, done)
    leaver = Call(gateway, "b", done, "leaver", timeout=0.5)
    leaver.join(10)
    assert leaver.status == -1  # the client gave up while queued
    wait_for(lambda: depth(gateway) == 0, 5, "the queue empty again")
    calls[0].join(30)
    assert done == ["holder"]


def test_a_wait_longer_than_max_wait_is_a_503(tmp: Path, sim: Sim) -> None:
    gw = start(tmp, "impatient", sim, "max_length = 10\nmax_wait = 0.3\n")
    try:
        done: list[str] = []
        holder = Call(gw, "a", done, "holder", HOLD)
        wait_for(lambda: metric(gw.url, "gateway_in_flight", backend="a") == 1, 5, "holder")
        late = Call(gw, "b", done, "late")
        late.join(10)
        assert late.status == 503 and '"queue_timeout"' in late.error
        holder.join(30)
        assert holder.status == 200
        assert metric(gw.url, "gateway_shed_total", reason="timeout") == 1
    finally:
        gw.stop()


def test_without_a_capacity_nothing_waits(tmp: Path, sim: Sim) -> None:
    gw = start(tmp, "open", sim, "", capacity=0)
    try:
        done: list[str] = []
        calls = [Call(gw, "a", done, str(i), "ttft=0.3") for i in range(4)]
        for call in calls:
            call.join(30)
        assert [c.status for c in calls] == [200] * 4
        assert metric(gw.url, "gateway_queue_wait_seconds_count") == 0
    finally:
        gw.stop()


def test_a_full_queue_lets_go_of_the_flooding_tenant_not_the_quiet_one(
        gateway: Gateway) -> None:
    done: list[str] = []
    calls = queue_up(gateway, done, ("a", "a1"), ("a", "a2"), ("a", "a3"))
    quiet = Call(gateway, "b", done, "b1")  # the queue is full, of a's requests only
    for call in [*calls, quiet]:
        call.join(30)
    assert quiet.status == 200
    assert sorted(c.status for c in calls) == [200, 200, 200, 503]
    evicted = next(c for c in calls if c.status == 503)
    assert '"queue_full"' in evicted.error
    # Round robin: a1 (a's turn), then b1, then a2; a3 (a's newest) was let go at once.
    assert done == ["a3", "holder", "a1", "b1", "a2"]


@pytest.mark.parametrize("pin_wait", [30.0, 0.0])
def test_a_session_waits_for_its_pinned_backend_within_the_bound(
        tmp: Path, sim: Sim, pin_wait: float) -> None:
    """Two backends of one place each: the session's own is busy, the other free. Within
    ``pin_wait`` it waits for its own (its prefix cache is there); with 0 it moves at once."""
    config = (f"[queue]\npin_wait = {pin_wait}\n[health]\ninterval = 0.3\n"
              + backend_toml("a", sim.url, "max_concurrent = 1")
              + backend_toml("b", sim.url, "max_concurrent = 1"))
    gw = Gateway(tmp, config, name=f"pinwait{int(pin_wait)}")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        done: list[str] = []
        held = Call(gw, "a", done, "holder", HOLD, session="s1")
        wait_for(lambda: sum(metric(gw.url, "gateway_in_flight", backend=b)
                             for b in "ab") == 1, 5, "holder in")
        follower = Call(gw, "a", done, "follower", session="s1")
        for call in (held, follower):
            call.join(30)
        assert held.status == follower.status == 200
        if pin_wait:
            assert done == ["holder", "follower"]  # it waited for the holder's place
            assert metric(gw.url, "gateway_sticky_total", result="hit") == 1
        else:
            assert done == ["follower", "holder"]  # it took the free backend
            assert metric(gw.url, "gateway_sticky_total", result="repin") == 1
    finally:
        gw.stop()


def test_a_place_freed_by_a_retry_wakes_the_queue_before_the_request_ends(tmp: Path) -> None:
    """Two backends of one place each: X holds one and Z the other, Y waits in the queue.
    X's backend answers 500 and X moves on (to wait for Z's backend): the place X's attempt
    freed goes to Y at once, while X and Z are both still running (issue 37)."""
    release_x, release_z = threading.Event(), threading.Event()

    def answer(conn: socket.socket, body: bytes) -> None:
        said = json.loads(body)["messages"][0]["content"]
        if said == "x":
            release_x.wait(30)
            reply, status = b'{"error":{"message":"boom","type":"x","code":500}}', b"500 Oops"
        else:
            if said == "z":
                release_z.wait(30)
            reply, status = (b'{"id":"c","object":"chat.completion","created":1,'
                             b'"model":"sim-model","choices":[{"index":0,"message":{"role":'
                             b'"assistant","content":"ok"},"finish_reason":"stop"}],'
                             b'"usage":{"prompt_tokens":1,"completion_tokens":1,'
                             b'"total_tokens":2}}'), b"200 OK"
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(reply) + reply)

    one, two = RawBackend(answer), RawBackend(answer)
    config = ("[health]\ninterval = 0.3\n[breaker]\nenabled = false\n"
              + backend_toml("one", one.url, "max_concurrent = 1")
              + backend_toml("two", two.url, "max_concurrent = 1"))
    gw = Gateway(tmp, config, name="retrywakes")
    done: list[str] = []

    def ask(said: str) -> None:
        reply = httpx.post(gw.url + "/v1/chat/completions", timeout=40, json={
            "model": "sim-model", "messages": [{"role": "user", "content": said}]})
        done.append(f"{said}:{reply.status_code}")

    def in_flight() -> float:
        return sum(metric(gw.url, "gateway_in_flight", backend=b) for b in ("one", "two"))

    callers = []
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        for said, busy in (("x", 1), ("z", 2)):
            callers.append(threading.Thread(target=ask, args=(said,), daemon=True))
            callers[-1].start()
            wait_for(lambda busy=busy: in_flight() == busy, 10,  # type: ignore[misc]
                     f"{said} on a backend")
        callers.append(threading.Thread(target=ask, args=("y",), daemon=True))
        callers[-1].start()
        wait_for(lambda: depth(gw) == 1, 10, "y queued")
        release_x.set()  # X's backend fails it; X waits for Z's backend, Y takes X's place
        wait_for(lambda: "y:200" in done, 10, "y answered in the place x's attempt freed")
        assert done == ["y:200"]  # X and Z still running
    finally:
        release_x.set()
        release_z.set()
        for caller in callers:
            caller.join(40)
        gw.stop()
        one.stop()
        two.stop()
