"""Tenants through the real gateway: named keys (literal, env:, sha256:), allowed models,
limits exact across two replicas sharing one Redis, 429 with Retry-After, token accounting
from vLLM's usage (streams included, the usage chunk the client did not ask for taken out
again), and the Redis-down policies."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, RedisServer, Sim, backend_toml, http_ok, metric, wait_for

ALICE, BOB, CAROL = "alice-secret-key-1", "bob-secret-key-22", "carol-secret-key-333"
MESSAGES = [{"role": "user", "content": "hello"}]


def keys(redis_down: str = "fail_open") -> str:
    digest = hashlib.sha256(BOB.encode()).hexdigest()
    return (f'[limits]\non_redis_down = "{redis_down}"\n'
            f'[[keys]]\nname = "alice"\nkey = "{ALICE}"\nrpm = 3\n'
            f'[[keys]]\nname = "bob"\nkey = "sha256:{digest}"\nmodels = ["sim-model"]\n'
            f'max_concurrent = 1\n'
            f'[[keys]]\nname = "carol"\nkey = "env:CAROL_KEY"\ntpm = 400\n')


def start(tmp: Path, name: str, sim: Sim, redis: RedisServer | None = None,
          policy: str = "fail_open") -> Gateway:
    shared = f'[redis]\nurl = "{redis.url}"\ntimeout = 0.5\n' if redis else ""
    config = (keys(policy) + shared + "[health]\ninterval = 0.3\n"
              + backend_toml("a", sim.url))
    gw = Gateway(tmp, config, name=name, env={"CAROL_KEY": CAROL})
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, f"{name} ready")
    return gw


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    server = Sim(tmp, "tenants", "--model", "sim-model", "--model", "other-model")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(tmp: Path, sim: Sim, redis_server: RedisServer) -> Iterator[tuple[Gateway, Gateway]]:
    """Two replicas sharing one Redis."""
    one, two = start(tmp, "one", sim, redis_server), start(tmp, "two", sim, redis_server)
    yield one, two
    one.stop()
    two.stop()


def sdk(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def chat(gw: Gateway, key: str, **extra: object) -> httpx.Response:
    body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2, **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {key}"})


def fresh_minute() -> None:
    """Limits count fixed minutes: start a counting test well inside one."""
    wait_for(lambda: time.time() % 60 < 50, 15, "a fresh minute window", every=0.5)


def test_requests_per_minute_hold_across_two_replicas(pair: tuple[Gateway, Gateway]) -> None:
    one, two = pair
    fresh_minute()
    answers = [chat(one, ALICE), chat(two, ALICE), chat(one, ALICE), chat(two, ALICE)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "alice" in error["message"] and ALICE not in refused.text
    assert metric(two.url, "gateway_limit_rejections_total", key="alice", limit="rpm") == 1


def test_a_digest_key_works_and_its_models_are_enforced(pair: tuple[Gateway, Gateway]) -> None:
    one, _ = pair
    assert chat(one, BOB).status_code == 200
    other = chat(one, BOB, model="other-model")
    assert other.status_code == 403 and other.json()["error"]["code"] == "model_not_allowed"
    assert chat(one, "sha256:" + hashlib.sha256(BOB.encode()).hexdigest()).status_code == 401


def test_concurrency_is_one_at_a_time_across_replicas(pair: tuple[Gateway, Gateway]) -> None:
    one, two = pair
    with httpx.Client(timeout=30) as http:
        headers = {"authorization": f"Bearer {BOB}", "x-sim": "ttft=1.5"}
        body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2, "stream": True}
        with http.stream("POST", one.url + "/v1/chat/completions", json=body,
                         headers=headers) as held:
            assert held.status_code == 200
            second = chat(two, BOB)  # while the first is in flight, on the other replica
            assert second.status_code == 429, second.text
            assert "requests in flight" in second.json()["error"]["message"]
            assert second.headers["retry-after"] == "1"
            held.read()
    # Its place is given back when it ends (off the request path: soon after).
    wait_for(lambda: chat(two, BOB).status_code == 200, 5, "bob's place given back")


def test_tokens_are_counted_per_key_and_model_streams_included(
        pair: tuple[Gateway, Gateway]) -> None:
    one, _ = pair
    before = metric(one.url, "gateway_tokens_total", key="carol", model="sim-model",
                    kind="completion")
    reply = sdk(one, CAROL).chat.completions.create(model="sim-model", messages=MESSAGES,
                                                     max_tokens=3)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    # A stream that did not ask for usage: the gateway asks and takes the chunk out again.
    chunks = list(sdk(one, CAROL).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " tok0 tok1 tok2 tok3"
    after = metric(one.url, "gateway_tokens_total", key="carol", model="sim-model",
                   kind="completion")
    assert after - before == 7
    assert metric(one.url, "gateway_tokens_total", key="carol", model="sim-model",
                  kind="prompt") > 0
    log = one.proc.output()
    assert '"key":"carol"' in log and CAROL not in log


def test_tokens_per_minute_refuse_once_spent(pair: tuple[Gateway, Gateway]) -> None:
    _, two = pair
    fresh_minute()
    statuses = [chat(two, CAROL, max_tokens=50).status_code for _ in range(12)]
    assert 429 in statuses
    refused = chat(two, CAROL, max_tokens=50)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"


def test_an_unknown_key_is_refused_and_x_api_key_is_accepted(
        pair: tuple[Gateway, Gateway]) -> None:
    one, _ = pair
    assert chat(one, "not-a-key-at-all").status_code == 401
    reply = httpx.post(one.url + "/v1/messages", timeout=10, headers={"x-api-key": BOB},
                       json={"model": "sim-model", "max_tokens": 2, "messages": MESSAGES})
    assert reply.status_code == 200


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_with_redis_down_the_policy_holds(tmp: Path, sim: Sim, policy: str) -> None:
    redis = RedisServer(tmp)
    gw = start(tmp, f"down-{policy}", sim, redis, policy)
    try:
        fresh_minute()
        assert chat(gw, ALICE).status_code == 200
        redis.stop()
        statuses = [chat(gw, ALICE).status_code for _ in range(4)]
        if policy == "fail_open":
            # This process's share (rpm 3 / 1 replica x 1 worker) counted locally.
            assert statuses == [200, 200, 200, 429]
        else:
            assert statuses == [503] * 4
    finally:
        gw.stop()
        redis.stop()


def test_the_admin_view_sums_each_keys_use_across_replicas(
        pair: tuple[Gateway, Gateway]) -> None:
    one, two = pair

    def bob() -> dict[str, Any]:
        view = httpx.get(one.url + "/admin/keys", timeout=5)
        assert view.status_code == 200
        for secret in (ALICE, BOB, CAROL):
            assert secret not in view.text
        entry: dict[str, Any] = next(k for k in view.json()["keys"] if k["name"] == "bob")
        return entry

    def used() -> tuple[int, int]:
        totals = bob()["totals"]
        return totals["requests"], totals["completion_tokens"]

    before = used()
    for gw in (one, two):
        sdk(gw, BOB).chat.completions.create(model="sim-model", messages=MESSAGES,
                                               max_tokens=3)  # type: ignore[arg-type]
    # Both replicas' requests (written off the request path, so: soon) in one total.
    wait_for(lambda: used() == (before[0] + 2, before[1] + 6), 5, "bob's use in the ledger")
    entry = bob()
    assert entry["max_concurrent"] == 1 and entry["models"] == ["sim-model"]
    assert httpx.get(one.url + "/admin/keys").json()["window_s"] == 3600


def test_a_reload_applies_new_keys_without_a_restart(tmp: Path, sim: Sim) -> None:
    """Rotating keys is a reload: a key taken out is refused at once, a new one (stored as
    a digest) and a flat api_keys entry are accepted, and nothing asks for a restart."""
    gw = start(tmp, "rekey", sim)
    try:
        assert chat(gw, ALICE).status_code == 200
        dave, flat = "dave-secret-key-4444", "flat-secret-key-55555"
        digest = hashlib.sha256(dave.encode()).hexdigest()
        text = gw.config_path.read_text()
        assert f'key = "{ALICE}"' in text
        text = text.replace("[gateway]\n", f'[gateway]\napi_keys = ["{flat}"]\n', 1)
        gw.config_path.write_text(text.replace(
            f'name = "alice"\nkey = "{ALICE}"', f'name = "dave"\nkey = "sha256:{digest}"'))
        reply = httpx.post(gw.url + "/admin/reload", json={"who": "test"}, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["needs_restart"] == []
        assert chat(gw, ALICE).status_code == 401
        assert chat(gw, dave).status_code == 200 and chat(gw, flat).status_code == 200
        names = {k["name"] for k in httpx.get(gw.url + "/admin/keys").json()["keys"]}
        assert names == {"api_keys.0", "dave", "bob", "carol"}
        assert dave not in gw.proc.output() and flat not in gw.proc.output()
    finally:
        gw.stop()
