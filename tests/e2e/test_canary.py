"""Canary rollouts between backend groups: real gateways, simulators, a real valkey."""

from __future__ import annotations

import asyncio
import getpass
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, Load, RedisServer, Sim, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BODY: dict[str, Any] = {"model": "llama", "max_tokens": 2, "messages": MESSAGES}
MODELS = '[[models]]\nname = "llama"\ngroups = { stable = "llama-v1", canary = "llama-v2" }\n'


def backends(stable: list[Sim], canary: list[Sim]) -> str:
    return "".join(
        f'\n[[backends]]\nname = "{group}{i}"\nurl = "{s.url}"\ngroup = "{group}"\n'
        for group, sims in (("stable", stable), ("canary", canary)) for i, s in enumerate(sims))


def start(tmp: Path, name: str, redis_url: str, canary: str, stable: list[Sim],
          canary_sims: list[Sim], prefix: str = "", extra: str = "") -> Gateway:
    config = (f'[redis]\nurl = "{redis_url}"\nkey_prefix = "{prefix or name}:"\n'
              "[health]\ninterval = 0.3\nrise = 1\n[breaker]\nenabled = false\n"
              f"{extra}[canary]\nenabled = true\n{canary}\n{MODELS}"
              + backends(stable, canary_sims))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    wait_for(lambda: "llama" in str(httpx.get(gw.url + "/v1/models").json()), 10,
             "both groups probed")
    return gw


def canary_state(gw: Gateway) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(gw.url + "/admin/canary").json()["state"]
    return state


def cli(gw: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--config",
                           str(gw.config_path)], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def groups(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    stable, canary = Sim(tmp, "stable", "--model", "llama-v1"), Sim(tmp, "canary", "--model",
                                                                    "llama-v2")
    yield stable, canary
    stable.stop()
    canary.stop()


def test_each_group_gets_its_own_model_name_and_the_client_sees_its_own(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    gw = start(tmp_path, "names", redis_server.url, "weight = 50", [groups[0]], [groups[1]])
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        seen = Counter()
        for i in range(40):
            raw = client.chat.completions.with_raw_response.create(
                model="llama", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
            assert raw.parse().model == "llama"
            seen[raw.headers["x-gateway-group"]] += 1
            chunks = list(client.chat.completions.create(
                model="llama", messages=MESSAGES, max_tokens=3, stream=True,  # type: ignore[arg-type]
                extra_headers={"x-session-id": f"s{i}"}))
            assert chunks and {c.model for c in chunks} == {"llama"}
        assert seen["stable"] and seen["canary"]  # both served, each under its own name
        assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == ["llama"]
    finally:
        gw.stop()


def test_five_percent_is_five_percent_and_sessions_keep_their_arm(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    gw = start(tmp_path, "split", redis_server.url, "weight = 5", [groups[0]], [groups[1]],
               extra="[degraded]\ncache = false\n")
    try:
        async def run() -> tuple[Counter[str], dict[str, set[str]]]:
            arms: Counter[str] = Counter()
            sessions: dict[str, set[str]] = {}
            sem = asyncio.Semaphore(32)
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                async def one(session: str | None) -> None:
                    async with sem:
                        r = await client.post(CHAT, json=BODY, headers={"x-session-id": session}
                                              if session else {})
                        assert r.status_code == 200
                        group = r.headers["x-gateway-group"]
                        if session is None:
                            arms[group] += 1
                        else:
                            sessions.setdefault(session, set()).add(group)
                await asyncio.gather(*(one(None) for _ in range(10_000)))
                for _ in range(3):
                    await asyncio.gather(*(one(f"user-{i}") for i in range(400)))
            return arms, sessions

        arms, sessions = asyncio.run(run())
        assert 400 <= arms["canary"] <= 600, arms  # 5 % +- 1 % of 10,000
        assert all(len(g) == 1 for g in sessions.values())  # no session changed arm
        in_canary = sum(g == {"canary"} for g in sessions.values())
        assert 5 <= in_canary <= 40, in_canary  # about 5 % of 400 sessions
    finally:
        gw.stop()


def test_operators_change_every_replica_and_each_change_is_an_event(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    one = start(tmp_path, "op1", redis_server.url, "weight = 0", [groups[0]], [groups[1]],
                prefix="ops")
    two = start(tmp_path, "op2", redis_server.url, "weight = 0", [groups[0]], [groups[1]],
                prefix="ops")
    try:
        sticky = {"x-session-id": "kept"}
        assert httpx.post(two.url + CHAT, json=BODY, headers=sticky).headers[
            "x-gateway-group"] == "stable"
        done = cli(one, "canary", "set", "canary", "30", "--why", "first users")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: canary_state(two)["weight"] == 30, 2, "replica two to follow")
        event = httpx.get(two.url + "/admin/canary").json()["events"][0]
        assert event["weight"] == 30 and event["why"] == "first users"
        assert event["by"] == f"{getpass.getuser()}@{socket.gethostname()}@127.0.0.1"
        assert "first users" in one.proc.output()
        for action, weight in (("rollback", 0), ("promote", 100)):
            assert cli(two, "canary", action, "--why", action).returncode == 0
            wait_for(lambda w=weight: canary_state(one)["weight"] == w, 2, f"{action} on one")
        # The session first seen in stable moved once its arm lost all weight.
        assert httpx.post(one.url + CHAT, json=BODY, headers=sticky).headers[
            "x-gateway-group"] == "canary"
        assert cli(one, "canary", "pause").returncode == 0
        wait_for(lambda: canary_state(two)["paused"], 2, "pause on two")
        status = cli(two, "canary", "status")
        assert status.stdout.startswith(
            "Canary group 'canary' gets 100 % of requests, stable group 'stable' 0 %; ")
        assert "; paused." in status.stdout.splitlines()[0]
        assert metric(two.url, "gateway_canary_weight", group="canary") == 100
    finally:
        one.stop()
        two.stop()


def rollout(steps: str = "[10, 50, 100]") -> str:
    return (f"[canary.rollout]\nenabled = true\nsteps = {steps}\nmin_requests = 20\n"
            "interval = 0\n")


def test_a_failing_canary_is_rolled_back_within_its_sample(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    stable = Sim(tmp_path, "good", "--model", "llama-v1")
    broken = Sim(tmp_path, "broken", "--model", "llama-v2", "--error-rate", "1.0")
    gw = start(tmp_path, "rollback", redis_server.url, rollout(), [stable], [broken],
               extra="[degraded]\ncache = false\n[upstream]\nmax_attempts = 1\n")
    try:
        statuses = Counter()
        while canary_state(gw)["phase"] == "rolling":
            statuses[httpx.post(gw.url + CHAT, json=BODY).status_code] += 1
            assert sum(statuses.values()) < 2000
        assert canary_state(gw)["phase"] == "rolled_back"
        assert canary_state(gw)["weight"] == 0
        assert broken.stats()["requests"] == 20  # exactly the configured sample
        assert statuses[500] == 20
        assert all(httpx.post(gw.url + CHAT, json=BODY).headers["x-gateway-group"] == "stable"
                   for _ in range(20))
        assert metric(gw.url, "gateway_group_requests_total", group="stable", outcome="error") == 0
        assert metric(gw.url, "gateway_group_requests_total", group="canary", outcome="error") == 20
        assert metric(gw.url, "gateway_canary_decisions_total", decision="rollback") == 1
        assert "rolled back: canary 20 req, 100.0% errors" in gw.proc.output()
    finally:
        gw.stop()
        stable.stop()
        broken.stop()


def test_a_healthy_canary_is_promoted_step_by_step_to_all_traffic(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    gw = start(tmp_path, "promote", redis_server.url, rollout(), [groups[0]], [groups[1]],
               extra="[degraded]\ncache = false\n")
    try:
        with Load(lambda: httpx.post(gw.url + CHAT, json=BODY).raise_for_status(), 4) as load:
            wait_for(lambda: canary_state(gw)["phase"] == "promoted", 60, "promotion")
        assert load.failures == 0
        state = canary_state(gw)
        assert state["weight"] == 100 and state["step"] == 2
        steps = [e["weight"] for e in httpx.get(gw.url + "/admin/canary").json()["events"]]
        assert steps[:3] == [100, 50, 10]  # newest first
        assert metric(gw.url, "gateway_canary_decisions_total", decision="advance") == 2
        assert metric(gw.url, "gateway_canary_step") == 2
        assert metric(gw.url, "gateway_group_ttft_seconds_count", group="canary") > 0
    finally:
        gw.stop()


def test_shadow_traffic_is_mirrored_not_answered_and_leaves_with_the_client(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    stable = Sim(tmp_path, "lead", "--model", "llama-v1:ttft=1")
    mirror = Sim(tmp_path, "mirror", "--model", "llama-v2:ttft=30")
    gw = start(tmp_path, "shadow", redis_server.url, "weight = 0\nshadow = 100", [stable],
               [mirror], extra="[degraded]\ncache = false\n")
    try:
        reply = httpx.post(gw.url + CHAT, json=BODY, timeout=10)
        assert reply.status_code == 200 and reply.headers["x-gateway-group"] == "stable"
        assert reply.json()["model"] == "llama"
        wait_for(lambda: mirror.stats()["running"] == 1, 5, "the mirrored request")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gw.url + CHAT, json=BODY, timeout=0.5)  # the client leaves
        wait_for(lambda: mirror.stats()["cancelled"] == 1, 5, "the mirror to be cancelled")
        # The first shadow, whose client stayed to the end, is still running: the one
        # cancelled is the second, whose client left.
        assert mirror.stats()["started"] == 2 and mirror.stats()["running"] == 1
        assert stable.stats()["cancelled"] == 1
    finally:
        gw.stop()
        stable.stop()
        mirror.stop()


def test_reload_swaps_backends_without_dropping_a_stream_and_refuses_bad_config(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    old = Sim(tmp_path, "old", "--model", "llama-v1", "--itl", "0.1")
    new = Sim(tmp_path, "new", "--model", "llama-v1")
    canary = Sim(tmp_path, "c", "--model", "llama-v2")
    gw = start(tmp_path, "reload", redis_server.url, "weight = 0", [old], [canary])
    try:
        text: list[str] = []

        def stream() -> None:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            for c in client.chat.completions.create(
                    model="llama", messages=MESSAGES, max_tokens=60, stream=True):  # type: ignore[arg-type]
                text.extend(ch.delta.content or "" for ch in c.choices)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: old.stats()["running"] == 1, 5, "the stream to start")
        original = gw.config_path.read_text()
        gw.config_path.write_text(original.replace(old.url, new.url).replace(
            "weight = 0", "weight = 20"))
        gw.proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded by SIGHUP" in gw.proc.output(), 5, "the reload")
        assert old.stats()["running"] == 1  # the reload landed while the stream ran
        reader.join(30)
        assert len([t for t in text if t]) == 60  # the stream on the removed backend finished
        wait_for(lambda: httpx.post(gw.url + CHAT, json=BODY).status_code == 200, 5, "serving")
        before = {s.url: s.stats()["requests"] for s in (old, new, canary)}
        assert all(httpx.post(gw.url + CHAT, json=BODY, headers={"x-session-id": "z"})
                   .status_code == 200 for _ in range(5))
        after = {s.url: s.stats()["requests"] - before[s.url] for s in (old, new, canary)}
        assert after[old.url] == 0 and after[new.url] + after[canary.url] == 5  # old is out
        assert canary_state(gw)["weight"] == 20 and canary_state(gw)["by"] == "SIGHUP"

        gw.config_path.write_text(original.replace("weight = 0", "weight = 200"))
        refused = cli(gw, "reload")
        assert refused.returncode == 2
        assert "canary.weight: Input should be less than or equal to 100" in refused.stderr
        reply = httpx.post(gw.url + "/admin/reload")
        assert reply.status_code == 400 and reply.json()["error"]["problems"]
        assert canary_state(gw)["weight"] == 20  # the running config stayed
        assert httpx.post(gw.url + CHAT, json=BODY).status_code == 200
    finally:
        gw.stop()
        for s in (old, new, canary):
            s.stop()


def test_a_canary_with_no_backend_left_sends_its_requests_to_stable(
    tmp_path: Path, redis_server: RedisServer, groups: tuple[Sim, Sim],
) -> None:
    """Found by the chaos soak: a canary group of one instance that failed or went away
    answered its arm's requests with 500 or 503 while stable could serve them; then, served
    by stable, its sessions' pins flipped between the groups on every request."""
    canary, second = Sim(tmp_path, "lone-canary", "--model", "llama-v2"), Sim(
        tmp_path, "second-stable", "--model", "llama-v1")
    gw = start(tmp_path, "fallback", redis_server.url, "weight = 100", [groups[0], second],
               [canary])
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

        def ask(session: str) -> tuple[str, str]:
            raw = client.chat.completions.with_raw_response.create(
                model="llama", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                extra_headers={"x-session-id": session})
            assert raw.parse().model == "llama"
            return raw.headers["x-gateway-group"], raw.headers["x-gateway-backend"]

        assert ask("s1") == ("canary", "canary0")
        httpx.post(canary.url + "/sim/fault", json={"set": "fault=500"}).raise_for_status()
        group, first = ask("s1")  # its 500 retried on stable (the budget's floor: 3 retries)
        assert group == "stable"
        assert ask("s1") == ("stable", first)  # hashed to one stable backend, not re-pinned
        canary.stop()
        wait_for(lambda: httpx.get(gw.url + "/readyz").json()["backends"]["canary0"] != "ready",
                 10, "the canary seen down")
        assert {ask("s1") for _ in range(6)} == {("stable", first)}
        assert ask("s2")[0] == "stable"
        pins = redis_server.client().keys("fallback:pin:*")
        assert [redis_server.client().get(k) for k in pins if k.endswith(":s1")] == ["canary0"]
        assert canary_state(gw)["weight"] == 100  # the rollout itself is unchanged
    finally:
        gw.stop()
        canary.stop()
        second.stop()
