"""Failure scenarios end to end: real gateways, simulators, a real valkey, the OpenAI SDK.

Breakers here open after 3 failures in a row. Scenarios covered elsewhere: connection
refused before any byte (test_limits_and_failures), failure after 3 chunks and all
backends failing (test_retries), client gone before headers (test_streaming).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, RedisServer, Sim, backend_toml, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello there"}]
BODY: dict[str, Any] = {"model": "sim-model", "max_tokens": 4, "messages": MESSAGES}
STATIC = "The service is busy; please try again in a minute."


def start(tmp: Path, name: str, sims: list[Sim], redis_url: str, extra: str = "",
          reset_timeout: float = 60.0, prefix: str = "") -> Gateway:
    """A gateway in front of ``sims``; its Redis keys are its own unless ``prefix`` says
    otherwise (the tests share one server, and breaker openings travel through it)."""
    config = (f'[redis]\nurl = "{redis_url}"\nkey_prefix = "{prefix or name}:"\n'
              'timeout = 0.2\nretry_interval = 0.3\n'
              "[routing]\nsticky = false\n[health]\ninterval = 0.3\nrise = 1\n"
              f"[breaker]\nfailure_threshold = 3\nreset_timeout = {reset_timeout}\n"
              f"sync_interval = 0.1\n{extra}"
              + "".join(backend_toml(f"s{i}", s.url) for i, s in enumerate(sims)))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    return gw


def breaker(gw: Gateway, name: str) -> dict[str, Any]:
    backends = httpx.get(gw.url + "/admin/status").json()["backends"]
    found: dict[str, Any] = next(b["breaker"] for b in backends if b["name"] == name)
    return found


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def post(gw: Gateway, sim: str = "", **extra: Any) -> httpx.Response:
    return httpx.post(gw.url + CHAT, json={**BODY, **extra}, timeout=30,
                      headers={"x-sim": sim} if sim else {})


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.stop()


def alone(tmp: Path, name: str, redis_url: str, cleanup: list[Any], *sim_args: str,
          **gateway: Any) -> tuple[Sim, Gateway]:
    """One simulator and a gateway in front of it, both stopped after the test."""
    sim = Sim(tmp, name, *sim_args)
    cleanup.append(sim)
    gw = start(tmp, name, [sim], redis_url, **gateway)
    cleanup.append(gw)
    return sim, gw


def test_backend_sigkilled_mid_stream_ends_with_an_error_the_sdk_raises(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    doomed = Sim(tmp_path, "doomed", "--itl", "0.1")
    cleanup.append(doomed)
    gw = start(tmp_path, "killed", [doomed], redis_server.url)
    cleanup.append(gw)
    stream = sdk(gw).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=100, stream=True)  # type: ignore[arg-type]
    got = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
            if len(got) == 3:
                doomed.proc.popen.send_signal(signal.SIGKILL)
    assert 3 <= len(got) < 100
    assert breaker(gw, "s0")["failures"] == 1
    assert metric(gw.url, "gateway_stream_failures_total", cause="dropped") == 1
    assert http_ok(gw.url + "/healthz")


def test_in_band_errors_in_200_streams_open_the_breaker(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    bad, good = Sim(tmp_path, "inband", "--model", "sim-model:fault=inband,after=2"), Sim(
        tmp_path, "fine")
    cleanup += [bad, good]
    gw = start(tmp_path, "inband", [bad, good], redis_server.url)
    cleanup.append(gw)
    client = sdk(gw)
    raised = 0
    for _ in range(8):
        try:
            for _ in client.chat.completions.create(
                model="sim-model", messages=MESSAGES, stream=True  # type: ignore[arg-type]
            ):
                pass
        except openai.APIError:
            raised += 1
    assert raised == 3  # least-loaded alternates until s0's breaker opens after 3
    assert breaker(gw, "s0")["state"] == "open"
    assert breaker(gw, "s1") == {"state": "closed", "failures": 0, "probes": 0,
                                 "opened_at": None}
    assert metric(gw.url, "gateway_stream_failures_total", cause="inband") == 3
    assert metric(gw.url, "gateway_breaker_state", backend="s0") == 2


def test_health_fine_but_completions_failing_is_ejected(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    bad, good = Sim(tmp_path, "liar", "--error-rate", "1.0"), Sim(tmp_path, "honest")
    cleanup += [bad, good]
    gw = start(tmp_path, "liar", [bad, good], redis_server.url)
    cleanup.append(gw)
    replies = [post(gw) for _ in range(30)]
    assert [r.status_code for r in replies] == [200] * 30  # retried within the budget
    assert bad.stats()["requests"] == 3  # then its breaker kept it out
    states = {b["name"]: b["state"] for b in httpx.get(gw.url + "/admin/status").json()[
        "backends"]}
    assert states == {"s0": "ready", "s1": "ready"}  # /health still says fine
    assert breaker(gw, "s0")["state"] == "open"
    assert metric(gw.url, "gateway_retries_total", reason="500") == 3


def test_client_errors_never_trip_but_a_5xx_streak_between_them_does(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    _, gw = alone(tmp_path, "picky", redis_server.url, cleanup, "--max-prompt-len", "40")
    long_prompt = [{"role": "user", "content": "word " * 50}]

    async def hundred() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> int:
                return (await client.post(gw.url + CHAT, json={
                    **BODY, "messages": long_prompt})).status_code
            return await asyncio.gather(*(one() for _ in range(100)))

    assert asyncio.run(hundred()) == [400] * 100  # context length: passed through verbatim
    assert breaker(gw, "s0") == {"state": "closed", "failures": 0, "probes": 0,
                                 "opened_at": None}
    for _ in range(3):
        assert post(gw, "fault=500").status_code == 500
        assert post(gw, messages=long_prompt).status_code == 400
    assert breaker(gw, "s0")["state"] == "open"


def test_busy_with_retry_after_backs_off_without_touching_the_breaker(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    busy, calm = Sim(tmp_path, "busy", "--busy-rate", "1.0", "--retry-after", "2"), Sim(
        tmp_path, "calm")
    cleanup += [busy, calm]
    gw = start(tmp_path, "busy", [busy, calm], redis_server.url)
    cleanup.append(gw)
    assert all(post(gw).status_code == 200 for _ in range(10))
    assert busy.stats()["requests"] == 1
    wait_for(lambda: post(gw).status_code == 200 and busy.stats()["requests"] == 2, 10,
             "the busy backend to be asked again after Retry-After")
    assert breaker(gw, "s0")["failures"] == 0


def test_half_open_lets_exactly_one_probe_through_out_of_fifty(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    sim, gw = alone(tmp_path, "probe", redis_server.url, cleanup, reset_timeout=1.0,
                    extra='panic = "degrade"\n[degraded]\ncache = false\n')
    for _ in range(3):
        post(gw, "fault=500")
    assert breaker(gw, "s0")["state"] == "open"
    assert post(gw).status_code == 503  # open: not even tried
    opened = datetime.fromisoformat(breaker(gw, "s0")["opened_at"])
    before = sim.stats()["requests"]
    wait_for(lambda: datetime.now(UTC) >= opened + timedelta(seconds=1.0), 5,
             "the reset timeout to pass")

    async def fifty() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            # The first request is the probe; it stays in flight until the other 49 have
            # been answered, however slowly they arrive.
            probe = asyncio.create_task(client.post(gw.url + CHAT, json=BODY,
                                                    headers={"x-sim": "ttft=30"}))
            while sim.stats()["running"] == 0:
                assert not probe.done(), probe.result().text
                await asyncio.sleep(0.02)
            rest = await asyncio.gather(*(client.post(gw.url + CHAT, json=BODY)
                                          for _ in range(49)))
            assert sim.stats()["running"] == 1  # the probe was in flight throughout
            probe.cancel()  # the client leaves: neither a success nor a failure
            return [r.status_code for r in rest]

    statuses = asyncio.run(fifty())
    assert sim.stats()["requests"] - before == 1
    assert statuses == [503] * 49
    wait_for(lambda: sim.stats()["running"] == 0, 5, "the probe to be cancelled")
    assert post(gw).status_code == 200  # the next probe succeeds
    assert breaker(gw, "s0")["state"] == "closed"


def test_long_prefill_is_not_a_timeout_and_leaves_the_breaker_alone(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    _, gw = alone(tmp_path, "prefill", redis_server.url, cleanup)
    reply = httpx.post(gw.url + CHAT, json=BODY, headers={"x-sim": "ttft=45"}, timeout=120)
    assert reply.status_code == 200 and reply.json()["choices"]
    assert breaker(gw, "s0")["failures"] == 0


def test_idle_stall_ends_the_stream_closes_upstream_and_counts(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    sim, gw = alone(tmp_path, "stall", redis_server.url, cleanup,
                    extra="[upstream]\nidle_timeout = 1.0\n")
    with pytest.raises(openai.APIError, match="stalled"):
        for _ in sdk(gw).chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
            extra_headers={"x-sim": "fault=stall,after=2"},
        ):
            pass
    wait_for(lambda: sim.stats()["cancelled"] == 1, 5, "the upstream to be closed")
    assert breaker(gw, "s0")["failures"] == 1
    assert metric(gw.url, "gateway_stream_failures_total", cause="stalled") == 1


def degraded_scenario(gw: Gateway, sim_name: str) -> None:
    """Cache a reply, open the only breaker, get the reply back (plain and streamed),
    then the static message for a question never asked."""
    asked = {"temperature": 0}
    first = post(gw, **asked)
    assert first.status_code == 200 and "x-gateway-degraded" not in first.headers
    answer = first.json()["choices"][0]["message"]["content"]
    for _ in range(3):
        post(gw, "fault=500")
    assert breaker(gw, sim_name)["state"] == "open"

    again = post(gw, **asked)
    assert again.headers["x-gateway-degraded"] == "cache"
    assert again.json()["choices"][0]["message"]["content"] == answer
    streamed = "".join(
        c.choices[0].delta.content or "" for c in sdk(gw).chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            stream=True) if c.choices)
    assert streamed == answer

    other = post(gw, **asked, max_tokens=2)
    assert other.headers["x-gateway-degraded"] == "static"
    assert other.json()["choices"][0]["message"]["content"] == STATIC
    embeddings = httpx.post(gw.url + "/v1/embeddings", json={"model": "sim-model",
                                                            "input": "x"})
    assert embeddings.status_code == 503 and embeddings.headers["retry-after"] == "5"


def test_all_breakers_open_answer_from_cache_then_static_then_recover(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    _, gw = alone(tmp_path, "only", redis_server.url, cleanup, reset_timeout=2.0,
                    extra=f'panic = "degrade"\n[degraded]\nstatic_message = "{STATIC}"\n')
    degraded_scenario(gw, "s0")
    assert metric(gw.url, "gateway_degraded_replies_total", kind="cache") == 2
    # 3 failed attempts (the backend's 500 replaced by the static message) + 1 unasked
    assert metric(gw.url, "gateway_degraded_replies_total", kind="static") == 4
    wait_for(lambda: "x-gateway-degraded" not in post(gw, temperature=0).headers, 10,
             "the gateway to serve from the backend again")
    assert breaker(gw, "s0")["state"] == "closed"


def test_redis_stopped_breakers_and_degraded_replies_keep_working(
    tmp_path: Path, cleanup: list[Any],
) -> None:
    server = RedisServer(tmp_path)
    sim = Sim(tmp_path, "alone")
    cleanup += [server, sim]
    gw = start(tmp_path, "noredis", [sim], server.url,
               extra=f'panic = "degrade"\n[degraded]\nstatic_message = "{STATIC}"\n')
    cleanup.append(gw)
    server.stop()
    degraded_scenario(gw, "s0")  # local breaker state, the in-process reply copy
    assert metric(gw.url, "gateway_redis_up") == 0
    assert "redis unavailable" in gw.proc.output()


def test_an_opening_reaches_every_gateway_through_redis(
    tmp_path: Path, redis_server: RedisServer, cleanup: list[Any],
) -> None:
    sims = [Sim(tmp_path, "shared0"), Sim(tmp_path, "shared1")]
    cleanup += sims
    one = start(tmp_path, "one", sims, redis_server.url, prefix="shared")
    two = start(tmp_path, "two", sims, redis_server.url, prefix="shared")
    cleanup += [one, two]
    for _ in range(3):
        post(one, "fault=500")  # retried on s1, which answers
    tripped = [n for n in ("s0", "s1") if breaker(one, n)["state"] == "open"]
    assert tripped
    wait_for(lambda: breaker(two, tripped[0])["state"] == "open", 3,
             "the other gateway to learn of the opening")
    here, there = (datetime.fromisoformat(breaker(gw, tripped[0])["opened_at"])
                   for gw in (one, two))
    assert abs((here - there).total_seconds()) < 0.001  # the same deadline everywhere
    assert "from another gateway process" in two.proc.output()
