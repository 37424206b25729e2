"""Three gateway replicas on one Valkey behave as one: a session lands on the same backend
and a canary arm is the same from any replica, a per-key limit holds across all three, a
breaker opened by one is open in all within the sync interval, a reply cached by one is
served by another, and killing one replica loses only its own streams."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_tenants import fresh_minute
from tests.helpers import Gateway, Load, RedisServer, Sim, backend_toml, http_ok, wait_for

FREE, LIMITED = "free-key-0000001", "limited-key-00002"
CHAT = "/v1/chat/completions"


def config(redis: RedisServer, sims: list[Sim], prefix: str, canary: str = "") -> str:
    return (f'[redis]\nurl = "{redis.url}"\nkey_prefix = "{prefix}:"\ntimeout = 1.0\n'
            "[health]\ninterval = 0.3\n[breaker]\nsync_interval = 0.2\n"
            f'[[keys]]\nname = "free"\nkey = "{FREE}"\n'
            f'[[keys]]\nname = "limited"\nkey = "{LIMITED}"\nrpm = 6\n'
            + (f"[canary]\nenabled = true\nweight = 50\nsync_interval = 0.1\n{canary}"
               if canary else "")
            + "".join(backend_toml(f"s{i}", s.url, 'group = "canary"' if canary and i == 3
                                   else "") for i, s in enumerate(sims)))


@contextmanager
def trio(tmp: Path, redis: RedisServer, sims: list[Sim], prefix: str,
         canary: str = "") -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    try:
        for n in range(3):
            gw = Gateway(tmp, config(redis, sims, prefix, canary), name=f"{prefix}{n}")
            started.append(gw)
        for gw in started:
            wait_for(lambda g=gw: http_ok(g.url + "/readyz"), 15, "replica ready")
        yield started
    finally:
        for gw in started:
            gw.stop()


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[list[Sim]]:
    out = [Sim(tmp, f"trio{i}", "--itl", "0.02") for i in range(4)]
    yield out
    for sim in out:
        sim.stop()


def ask(gw: Gateway, key: str = FREE, session: str | None = None,
        **extra: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}",
               **({"x-session-id": session} if session else {})}
    return httpx.post(gw.url + CHAT, headers=headers, timeout=30, json={
        "model": "sim-model", "max_tokens": 3,
        "messages": [{"role": "user", "content": "hello"}], **extra})


def test_sessions_arms_and_limits_are_one_across_three_replicas(
        tmp: Path, redis_server: RedisServer, sims: list[Sim]) -> None:
    with trio(tmp, redis_server, sims, "one", canary="\n") as gws:
        seen: dict[str, set[tuple[str, str]]] = {}
        for turn in range(3):
            for n in range(12):
                reply = ask(gws[(n + turn) % 3], session=f"conv-{n}")
                assert reply.status_code == 200, reply.text
                seen.setdefault(f"conv-{n}", set()).add(
                    (reply.headers["x-gateway-group"], reply.headers["x-gateway-backend"]))
        assert all(len(v) == 1 for v in seen.values()), seen  # one arm, one backend each
        assert {g for v in seen.values() for g, _ in v} == {"stable", "canary"}
        fresh_minute()
        codes = [ask(gws[n % 3], LIMITED).status_code for n in range(9)]
        assert 6 <= codes.count(200) <= 7 and codes.count(429) == 9 - codes.count(200), codes


def breaker(gw: Gateway, name: str) -> str:
    backends = httpx.get(gw.url + "/admin/status").json()["backends"]
    state: str = next(b for b in backends if b["name"] == name)["breaker"]["state"]
    return state


def test_a_breaker_opened_by_one_is_open_in_all_and_one_cache_serves_all(
        tmp: Path, redis_server: RedisServer, sims: list[Sim]) -> None:
    with trio(tmp, redis_server, sims[:3], "two") as gws:
        cached = ask(gws[0], temperature=0)
        assert cached.status_code == 200
        try:
            httpx.post(sims[1].url + "/sim/fault", json={"set": "fault=500"}).raise_for_status()
            for _ in range(30):
                ask(gws[0])  # failures on s1 are retried elsewhere until its breaker opens
                if breaker(gws[0], "s1") == "open":
                    break
            assert breaker(gws[0], "s1") == "open"
            wait_for(lambda: all(breaker(g, "s1") == "open" for g in gws[1:]), 3,
                     "the others open it within their sync interval")
            for sim in sims[:3]:
                httpx.post(sim.url + "/sim/fault", json={"set": "fault=500"}).raise_for_status()
            again = ask(gws[2], temperature=0)  # no backend can answer: the shared cache does
            assert again.status_code == 200 and again.headers["x-gateway-degraded"] == "cache"
            assert again.json()["choices"] == cached.json()["choices"]
        finally:
            for sim in sims[:3]:
                httpx.post(sim.url + "/sim/fault", json={"set": ""})


def test_killing_one_replica_loses_only_its_own_streams(
        tmp: Path, redis_server: RedisServer, sims: list[Sim]) -> None:
    with trio(tmp, redis_server, sims[:3], "three") as gws:
        def streamer(gw: Gateway) -> Load:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=FREE, max_retries=0)

            def stream() -> None:
                chunks = list(client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=40, stream=True))
                assert chunks[-1].choices[0].finish_reason == "length"
            return Load(stream, threads=3)

        loads = [streamer(gw) for gw in gws]
        for load in loads:
            load.__enter__()
        try:
            wait_for(lambda: all(len(ld.outcomes) >= 3 for ld in loads), 30, "streams flowing")
            os.killpg(gws[2].proc.popen.pid, signal.SIGKILL)  # the replica and its workers
            wait_for(lambda: loads[2].failures >= 1, 10, "the killed replica's streams fail")
            done = [len(ld.outcomes) for ld in loads[:2]]
            wait_for(lambda: all(len(ld.outcomes) >= n + 6 for ld, n in zip(loads, done,
                                                                             strict=False)),
                     30, "the others' streams go on")
        finally:
            for load in loads:
                load.__exit__(None, None, None)
        assert loads[0].failures == loads[1].failures == 0
