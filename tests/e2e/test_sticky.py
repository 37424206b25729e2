"""Session-sticky routing through real gateways and a real Redis (valkey) server."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    Gateway,
    Load,
    RedisServer,
    Sim,
    backend_toml,
    http_ok,
    sim_group,
    wait_for,
)

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def trio(tmp: Path) -> Iterator[list[Sim]]:
    with sim_group(tmp, "t", 3) as started:
        yield started


def sticky_config(sims: list[Sim], redis_url: str, extra: str = "") -> str:
    return (f'[redis]\nurl = "{redis_url}"\ntimeout = 0.2\nretry_interval = 0.5\n'
            f"[routing]\nsession_ttl = 30\n{extra}[health]\ninterval = 0.5\nrise = 1\n"
            + "".join(backend_toml(f"t{i}", s.url) for i, s in enumerate(sims)))


@pytest.fixture(scope="module")
def pair(tmp: Path, trio: list[Sim], redis_server: RedisServer) -> Iterator[list[Gateway]]:
    gws = [Gateway(tmp, sticky_config(trio, redis_server.url), name=f"sticky{i}")
           for i in range(2)]
    for gw in gws:
        wait_for(lambda gw=gw: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    yield gws
    for gw in gws:
        gw.stop()


def backend_for(gw: Gateway, session: str, **headers: str) -> str:
    resp = httpx.post(gw.url + CHAT, json=BODY, headers={"x-session-id": session, **headers})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-gateway-backend"]


def metric(gw: Gateway, name: str, labels: str = "") -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_one_hundred_concurrent_first_requests_share_one_backend(pair: list[Gateway]) -> None:
    async def main() -> set[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            replies = await asyncio.gather(*(
                client.post(pair[i % 2].url + CHAT, json=BODY,
                            headers={"x-session-id": "burst-session"})
                for i in range(100)))
        assert all(r.status_code == 200 for r in replies)
        return {r.headers["x-gateway-backend"] for r in replies}

    assert len(asyncio.run(main())) == 1


def test_two_gateways_agree_and_sessions_spread(pair: list[Gateway]) -> None:
    placed = {f"user-{i}": backend_for(pair[0], f"user-{i}") for i in range(12)}
    assert all(backend_for(pair[1], s) == b for s, b in placed.items())
    assert len(set(placed.values())) >= 2  # new sessions follow the load-aware policy


def test_session_key_from_body_user_is_matched_exactly(pair: list[Gateway]) -> None:
    def via_user(user: str) -> str:
        resp = httpx.post(pair[0].url + CHAT, json={**BODY, "user": user})
        return resp.headers["x-gateway-backend"]

    first = via_user("alice")
    assert all(via_user("alice") == first for _ in range(5))
    too_long = httpx.post(pair[0].url + CHAT, json=BODY, headers={"x-session-id": "x" * 300})
    assert too_long.status_code == 400


def test_later_requests_refresh_the_ttl(pair: list[Gateway], redis_server: RedisServer) -> None:
    backend_for(pair[0], "ttl-session")
    client = redis_server.client()
    key = "vgw:pin:sim-model:ttl-session"
    client.pexpire(key, 5000)
    backend_for(pair[0], "ttl-session")
    assert client.pttl(key) > 25_000


def test_a_draining_pin_is_moved_once_and_stays(pair: list[Gateway]) -> None:
    gw = pair[0]
    first = backend_for(gw, "mover")
    repins = metric(gw, "gateway_sticky_total", '{result="repin"}')
    httpx.post(f"{gw.url}/admin/backends/{first}/drain", json={"then": "none"}, timeout=30)
    try:
        second = backend_for(gw, "mover")
        assert second != first
        assert metric(gw, "gateway_sticky_total", '{result="repin"}') == repins + 1
    finally:
        httpx.post(f"{gw.url}/admin/backends/{first}/start", timeout=30)
    wait_for(lambda: httpx.get(gw.url + "/admin/status").json()["backends"][
        int(first[1:])]["state"] == "ready", 10, f"{first} back")
    assert all(backend_for(gw, "mover") == second for _ in range(4))  # no flapping back


def test_a_restarted_gateway_keeps_the_pins(tmp: Path, trio: list[Sim],
                                            redis_server: RedisServer) -> None:
    gw = Gateway(tmp, sticky_config(trio, redis_server.url), name="restartee")
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    sessions = [f"keep-{i}" for i in range(6)]
    placed = {s: backend_for(gw, s) for s in sessions}
    gw.stop()
    again = Gateway(tmp, sticky_config(trio, redis_server.url), name="restarted")
    try:
        wait_for(lambda: http_ok(again.url + "/readyz"), 10, "gateway ready")
        # In the reverse order, a fresh round robin would place 4 of the 6 elsewhere; and
        # every answer must come from a pin read back, none from a new one.
        assert {s: backend_for(again, s) for s in reversed(sessions)} == placed
        assert metric(again, "gateway_sticky_total", '{result="hit"}') == len(sessions)
        assert metric(again, "gateway_sticky_total", '{result="miss"}') == 0
    finally:
        again.stop()


def test_a_hung_redis_costs_a_request_at_most_its_timeout(tmp: Path, trio: list[Sim],
                                                          redis_server: RedisServer) -> None:
    """SIGSTOP, not kill: connections stay open and commands go unanswered (redis.timeout)."""
    gw = Gateway(tmp, sticky_config(trio, redis_server.url), name="hung")
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    sessions = [f"hung-{i}" for i in range(8)]
    placed = {s: backend_for(gw, s) for s in sessions}
    sent = iter(range(10**9))
    hung: list[str] = []  # ids of requests sent and answered while Redis was stopped
    stopped: list[bool] = [False]

    def one_request() -> None:
        n = next(sent)
        during = stopped[0]
        rid = f"hung-request-{n}"
        resp = httpx.post(gw.url + CHAT, json=BODY, timeout=10, headers={
            "x-session-id": sessions[n % len(sessions)], "x-request-id": rid})
        resp.raise_for_status()
        if during and stopped[0]:
            hung.append(rid)

    fallbacks = metric(gw, "gateway_sticky_total", '{result="fallback"}')
    try:
        with Load(one_request, threads=4) as load:
            wait_for(lambda: len(load.outcomes) > 20, 10, "load running")
            redis_server.popen.send_signal(signal.SIGSTOP)
            stopped[0] = True
            try:
                wait_for(lambda: len(hung) > 30, 30, "requests while Redis hangs")
                assert metric(gw, "gateway_sticky_total", '{result="fallback"}') > fallbacks
                assert metric(gw, "gateway_redis_up") == 0
            finally:
                stopped[0] = False
                redis_server.popen.send_signal(signal.SIGCONT)
            wait_for(lambda: metric(gw, "gateway_redis_up") == 1, 10, "redis answers again")
        assert load.failures == 0
        # Each took about redis.timeout (0.2 s) at most, by the gateway's own clock (this
        # busy machine's clients are slower than that): a generous margin on top, far
        # below what a request waiting on the hung Redis would take.
        took = access_durations(gw, hung)
        assert len(took) == len(hung) and max(took) < (0.2 + 1.0) * 1000, sorted(took)[-5:]
        hits = metric(gw, "gateway_sticky_total", '{result="hit"}')
        assert {s: backend_for(gw, s) for s in sessions} == placed  # the pins, used again
        assert metric(gw, "gateway_sticky_total", '{result="hit"}') == hits + len(sessions)
    finally:
        redis_server.popen.send_signal(signal.SIGCONT)
        gw.stop()


def access_durations(gw: Gateway, ids: list[str]) -> list[float]:
    wanted = set(ids)
    lines = (json.loads(line) for line in gw.proc.output().splitlines()
             if line.startswith("{") and '"gateway.access"' in line)
    return [float(entry["duration_ms"]) for entry in lines if entry.get("id") in wanted]


def test_redis_outage_under_load_falls_back_and_recovers(tmp: Path, trio: list[Sim]) -> None:
    server = RedisServer(tmp)
    gws = [Gateway(tmp, sticky_config(trio, server.url), name=f"outage{i}") for i in range(2)]
    sent = iter(range(10**9))

    def one_request() -> None:
        i = next(sent)
        resp = httpx.post(gws[i % 2].url + CHAT, json=BODY,
                          headers={"x-session-id": f"load-{i % 20}"}, timeout=10)
        resp.raise_for_status()

    try:
        for gw in gws:
            wait_for(lambda gw=gw: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        sessions = [f"o-{i}" for i in range(8)]
        with Load(one_request, threads=1) as load:
            wait_for(lambda: len(load.outcomes) > 20, 10, "load running")
            server.stop()
            started = time.monotonic()
            # Both gateways keep serving, and agree on where each session goes (rendezvous).
            down = [{s: backend_for(gw, s) for s in sessions} for gw in gws]
            assert down[0] == down[1]
            assert time.monotonic() - started < 10
            for gw in gws:
                assert metric(gw, "gateway_redis_up") == 0
                assert metric(gw, "gateway_sticky_total", '{result="fallback"}') >= 1
                assert gw.proc.output().count("redis unavailable") == 1
            server.start()

            def redis_back() -> bool:
                for gw in gws:
                    backend_for(gw, "probe")  # a request makes the gateway try Redis again
                return all(metric(gw, "gateway_redis_up") == 1 for gw in gws)

            wait_for(redis_back, 10, "redis back in use")
        assert len(load.outcomes) > 40 and load.failures == 0
        placed = {s: backend_for(gws[0], s) for s in sessions}
        assert {s: backend_for(gws[1], s) for s in sessions} == placed
        assert all(gw.proc.output().count("redis answers again") == 1 for gw in gws)
    finally:
        for gw in gws:
            gw.stop()
        server.stop()
