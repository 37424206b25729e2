"""The gateway's queue, through the real gateway against simulators: a full queue answers
503 with Retry-After at once, a client that hangs up leaves it at once, nothing waits
without a capacity, and a session waits for its pinned backend within ``pin_wait``. The
queue's order (priority bands, round robin across tenants), its bounds (length, the
busiest tenant's newest let go, max_wait) and the wake at a retry are tested alone in
``tests/gateway/routing/test_queue.py`` and ``tests/gateway/proxy/test_proxy.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, metric, wait_for

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
