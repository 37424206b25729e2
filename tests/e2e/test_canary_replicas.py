"""The canary across gateway replicas sharing one Redis: session arms that survive a
weight change, and one analyst deciding for everyone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Gateway, Load, RedisServer, Sim, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {"model": "llama", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}
MODELS = '[[models]]\nname = "llama"\ngroups = { stable = "llama-v1", canary = "llama-v2" }\n'
SESSIONS = [f"user-{i}" for i in range(400)]


@pytest.fixture(scope="module")
def groups(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    stable = Sim(tmp, "r-stable", "--model", "llama-v1")
    canary = Sim(tmp, "r-canary", "--model", "llama-v2")
    yield stable, canary
    stable.stop()
    canary.stop()


def replica(tmp: Path, name: str, redis_url: str, prefix: str, canary: str,
            groups: tuple[Sim, Sim]) -> Gateway:
    config = (f'[redis]\nurl = "{redis_url}"\nkey_prefix = "{prefix}:"\ntimeout = 2.0\n'
              "[health]\ninterval = 0.3\nrise = 1\n[breaker]\nenabled = false\n"
              f"[degraded]\ncache = false\n[canary]\nenabled = true\n{canary}\n{MODELS}"
              f'\n[[backends]]\nname = "s"\nurl = "{groups[0].url}"\ngroup = "stable"\n'
              f'\n[[backends]]\nname = "c"\nurl = "{groups[1].url}"\ngroup = "canary"\n')
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    wait_for(lambda: "llama" in httpx.get(gw.url + "/v1/models").text, 10, "both groups probed")
    return gw


def weight(gw: Gateway) -> float:
    return float(httpx.get(gw.url + "/admin/canary").json()["state"]["weight"])


def arms_of(gw: Gateway, sessions: list[str]) -> dict[str, str]:
    """The arm (x-gateway-group) each session's request lands in, 32 at a time."""
    async def run() -> dict[str, str]:
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            async def one(session: str) -> tuple[str, str]:
                async with sem:
                    r = await client.post(CHAT, json=BODY, headers={"x-session-id": session})
                    assert r.status_code == 200, r.text
                    return session, r.headers["x-gateway-group"]
            return dict(await asyncio.gather(*(one(s) for s in sessions)))

    return asyncio.run(run())


def test_sessions_keep_their_arm_across_a_weight_change_on_every_replica(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    one = replica(tmp_path, "arm1", redis_server.url, "arms", "weight = 5", groups)
    two = replica(tmp_path, "arm2", redis_server.url, "arms", "weight = 5", groups)
    try:
        first = arms_of(one, SESSIONS)
        in_canary = sum(arm == "canary" for arm in first.values())
        assert 5 <= in_canary <= 40, in_canary  # about 5 % of 400
        stored = redis_server.client().mget([f"arms:arm:llama:{s}" for s in SESSIONS])
        assert stored == [first[s] for s in SESSIONS]  # one arm: key per session, its arm

        changed = httpx.post(one.url + "/admin/canary/set",
                             json={"group": "canary", "weight": 50, "why": "wider"})
        assert changed.status_code == 200, changed.text
        wait_for(lambda: weight(one) == weight(two) == 50, 5, "both replicas at 50 %")
        # Without the stored arms about 45 % of the sessions would now hash into the canary.
        assert arms_of(two, SESSIONS) == first
        assert arms_of(one, SESSIONS) == first
        fresh = arms_of(two, [f"new-{i}" for i in range(200)])
        assert 60 <= sum(arm == "canary" for arm in fresh.values()) <= 140  # new ones: 50 %
    finally:
        one.stop()
        two.stop()


def phase(gw: Gateway) -> tuple[float, str]:
    state = httpx.get(gw.url + "/admin/canary").json()["state"]
    return state["weight"], state["phase"]


def leader_pid(redis: RedisServer, prefix: str) -> int:
    holder: str = redis.client().get(f"{prefix}:canary:leader")
    return int(holder.split("-")[0])


def test_one_elected_replica_analyses_the_rollout_and_another_takes_over_when_it_goes(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    # Each step lasts at least 3 s: time to see the first one on both replicas.
    rollout = ("[canary.rollout]\nenabled = true\nsteps = [10, 50, 100]\nmin_requests = 10\n"
               "interval = 3\n")
    gws = [replica(tmp_path, f"lead{i}", redis_server.url, "lead", rollout, groups)
           for i in (1, 2)]
    clients = [httpx.Client(base_url=gw.url, timeout=30) for gw in gws]

    def load(on: list[httpx.Client]) -> Load:
        def send() -> None:
            for client in on:
                client.post(CHAT, json=BODY).raise_for_status()
        return Load(send, threads=4)

    try:
        with load(clients) as both:
            wait_for(lambda: all(phase(gw) == (50, "rolling") for gw in gws), 60,
                     "the first step on both replicas")
        assert both.outcomes and both.failures == 0
        decided = [metric(gw.url, "gateway_canary_decisions_total", decision="advance")
                   for gw in gws]
        assert sorted(decided) == [0, 1]  # one analyst for both
        leader, follower = (gws[0], gws[1]) if decided[0] else (gws[1], gws[0])
        assert httpx.get(leader.url + "/healthz").json()["pid"] == leader_pid(redis_server,
                                                                                 "lead")
        leader.stop()  # its lease runs out and the other replica is elected
        with load([clients[gws.index(follower)]]) as alone:
            wait_for(lambda: phase(follower) == (100, "promoted"), 60, "the promotion")
        assert alone.outcomes and alone.failures == 0
        assert metric(follower.url, "gateway_canary_decisions_total", decision="advance") == 1
        pid = httpx.get(follower.url + "/healthz").json()["pid"]
        assert leader_pid(redis_server, "lead") == pid
        events = httpx.get(follower.url + "/admin/canary").json()["events"]
        assert [e["weight"] for e in events if e["by"] == "analysis"] == [100, 50]
    finally:
        for client in clients:
            client.close()
        for gw in gws:
            gw.stop()
