"""A model the config declares is known whether or not a backend has answered for it yet
(issue 36): when ``big``'s only backend has been down since the gateway started, a request
for ``big`` is answered by its fallback model, the reply cache or the static reply, and
otherwise gets a 503; only a model nobody declared gets the 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, RedisServer, Sim, free_port, http_ok, wait_for

CHAT = "/v1/chat/completions"


def ask(gw: Gateway, model: str, text: str = "hello") -> httpx.Response:
    return httpx.post(gw.url + CHAT, timeout=10, json={
        "model": model, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": text}]})


def config(redis_url: str, big_url: str, small_url: str, extra: str = "") -> str:
    return (f'[redis]\nurl = "{redis_url}"\nkey_prefix = "declared:"\n'
            '[health]\ninterval = 0.2\nrise = 1\nfall = 1\n' + extra +
            '[[models]]\nname = "big"\nfallback = "small"\n'
            '[[models]]\nname = "quiet"\n'
            f'[[backends]]\nname = "big0"\nurl = "{big_url}"\n'
            f'[[backends]]\nname = "small0"\nurl = "{small_url}"\n')


@pytest.fixture(scope="module")
def small(tmp: Path) -> Iterator[Sim]:
    sim = Sim(tmp, "declared-small", "--model", "small")
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def never_up(tmp: Path, small: Sim, redis_server: RedisServer) -> Iterator[Gateway]:
    """``big``'s backend has never answered since this gateway started."""
    dead = f"http://127.0.0.1:{free_port()}"
    gw = Gateway(tmp, config(redis_server.url, dead, small.url), name="declared-never-up")
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready (small only)")
    yield gw
    gw.stop()


def test_the_fallback_answers_for_a_model_whose_backend_never_came_up(
    never_up: Gateway,
) -> None:
    reply = ask(never_up, "big")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-gateway-degraded"] == "fallback"
    assert reply.headers["x-gateway-backend"] == "small0"
    assert reply.json()["model"] == "small"
    client = openai.OpenAI(base_url=never_up.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="big", messages=[{"role": "user", "content": "streamed"}], max_tokens=3,
        temperature=0, stream=True)
    assert raw.headers["x-gateway-degraded"] == "fallback"
    assert {c.model for c in raw.parse()} == {"small"}


def test_a_declared_model_with_nothing_to_answer_gets_503_and_an_invented_one_404(
    never_up: Gateway,
) -> None:
    quiet = ask(never_up, "quiet")  # declared, no fallback, no static message
    assert quiet.status_code == 503, quiet.text
    assert quiet.json()["error"]["type"] == "service_unavailable"
    assert "retry-after" in quiet.headers
    invented = ask(never_up, "invented")
    assert invented.status_code == 404
    assert invented.json()["error"]["message"] == "The model `invented` does not exist."


def test_a_declared_model_is_not_listed_until_a_backend_serves_it(never_up: Gateway) -> None:
    listed = {m["id"] for m in httpx.get(never_up.url + "/v1/models").json()["data"]}
    assert listed == {"small"}


def test_the_static_reply_answers_a_declared_model_whose_backend_never_came_up(
    tmp: Path, small: Sim, redis_server: RedisServer,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = Gateway(tmp, config(redis_server.url, dead, small.url,
                             '[degraded]\nstatic_message = "later, please"\n'),
                 name="declared-static")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        reply = ask(gw, "quiet")
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-gateway-degraded"] == "static"
        assert reply.json()["choices"][0]["message"]["content"] == "later, please"
    finally:
        gw.stop()


def test_a_reply_kept_before_a_restart_answers_when_the_backend_never_came_back(
    tmp: Path, small: Sim, redis_server: RedisServer,
) -> None:
    """The issue 16 case: the reply cache (in Redis) outlives the gateway, and the restarted
    gateway, whose ``big`` backend is down from the start, answers from it."""
    big = Sim(tmp, "declared-big", "--model", "big")
    first = Gateway(tmp, config(redis_server.url, big.url, small.url), name="declared-before")
    try:
        wait_for(lambda: ask(first, "big", "warm").headers.get("x-gateway-backend") == "big0",
                 10, "big0 to answer")
        kept = ask(first, "big", "kept")
        assert kept.headers["x-gateway-backend"] == "big0"
        answer = kept.json()["choices"][0]["message"]["content"]
        wait_for(lambda: redis_server.client().keys("declared:reply:*"), 5, "the kept reply")
    finally:
        first.stop()
        big.stop()
    again = Gateway(tmp, config(redis_server.url, big.url, small.url), name="declared-after")
    try:
        wait_for(lambda: http_ok(again.url + "/readyz"), 10, "gateway ready (small only)")
        reply = ask(again, "big", "kept")
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-gateway-degraded"] == "cache"
        assert reply.json()["choices"][0]["message"]["content"] == answer
    finally:
        again.stop()
