"""The reply cache is shared through Redis: a reply one gateway process kept answers for
another process, and for the same gateway after a restart, when no backend can.

Each gateway here has its own simulator, stopped when the test needs that gateway to have
no backend; the in-process copy of the gateway that cached the reply is never asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.helpers import Gateway, RedisServer, Sim, backend_toml, http_ok, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "what is shared?"}]
ASKED: dict[str, Any] = {"model": "sim-model", "max_tokens": 5, "temperature": 0,
                         "messages": MESSAGES}


def gateway(tmp: Path, name: str, sim: Sim, redis_url: str, prefix: str,
            extra: str = "") -> Gateway:
    config = (f'[redis]\nurl = "{redis_url}"\nkey_prefix = "{prefix}:"\ntimeout = 2.0\n'
              "[routing]\nsticky = false\n[health]\ninterval = 0.2\nfall = 1\nrise = 1\n"
              f"{extra}" + backend_toml("s", sim.url))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, f"{name} ready")
    return gw


def no_backend(gw: Gateway, sim: Sim) -> None:
    """Stop ``gw``'s only backend and wait until the gateway knows it."""
    sim.stop()
    ready = wait_for(lambda: (r := httpx.get(gw.url + "/readyz")).status_code == 503 and r, 10,
                     "/readyz to answer 503")
    assert ready.json() == {"ready": False, "backends": {"s": "unhealthy"}}


def reply_keys(redis: RedisServer, prefix: str) -> list[str]:
    keys: list[str] = redis.client().keys(f"{prefix}:reply:*")
    return keys


def stream_text(gw: Gateway) -> tuple[str, httpx.Headers]:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
            model="sim-model", messages=MESSAGES, max_tokens=5, temperature=0,  # type: ignore[arg-type]
            stream=True) as raw:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        return text, raw.headers


def assert_answers_from_cache(gw: Gateway, answer: str) -> None:
    plain = httpx.post(gw.url + CHAT, json=ASKED, timeout=10)
    assert plain.status_code == 200, plain.text
    assert plain.headers["x-gateway-degraded"] == "cache"
    assert plain.json()["choices"][0]["message"]["content"] == answer
    text, headers = stream_text(gw)  # the same question, streamed: replayed as SSE
    assert headers["x-gateway-degraded"] == "cache"
    assert headers["content-type"].startswith("text/event-stream")
    assert text == answer


def test_a_streamed_reply_cached_by_one_gateway_answers_for_another_and_after_a_restart(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    first, second = Sim(tmp_path, "rc-a"), Sim(tmp_path, "rc-b")
    a = gateway(tmp_path, "rc-a", first, redis_server.url, "rc")
    b = gateway(tmp_path, "rc-b", second, redis_server.url, "rc")
    restarted = None
    try:
        answer, headers = stream_text(a)  # streamed, temperature 0: folded and kept
        assert answer and "x-gateway-degraded" not in headers
        wait_for(lambda: reply_keys(redis_server, "rc"), 5, "the reply: key in Redis")
        no_backend(b, second)
        assert_answers_from_cache(b, answer)  # b never saw the reply itself

        a.stop()  # a restarts: its in-process copy is gone, Redis still holds the reply
        restarted = gateway(tmp_path, "rc-a2", first, redis_server.url, "rc")
        no_backend(restarted, first)
        assert_answers_from_cache(restarted, answer)
    finally:
        for thing in (restarted, a, b, first, second):
            if thing is not None:
                thing.stop()


def test_an_expired_reply_is_no_longer_served(tmp_path: Path, redis_server: RedisServer) -> None:
    sim = Sim(tmp_path, "ttl")
    gw = gateway(tmp_path, "ttl", sim, redis_server.url, "ttl",
                 '[degraded]\ncache_ttl = 1.0\nlocal_entries = 0\nstatic_message = "later"\n')
    try:
        assert httpx.post(gw.url + CHAT, json=ASKED).status_code == 200
        (key,) = wait_for(lambda: reply_keys(redis_server, "ttl"), 5, "the reply: key")
        assert 0 < redis_server.client().pttl(key) <= 1000
        no_backend(gw, sim)
        wait_for(lambda: not redis_server.client().exists(key), 5, "the entry to expire")
        late = httpx.post(gw.url + CHAT, json=ASKED)
        assert late.headers["x-gateway-degraded"] == "static"
        assert json.loads(late.text)["choices"][0]["message"]["content"] == "later"
    finally:
        gw.stop()
        sim.stop()


def test_an_expired_reply_is_not_served_from_the_in_process_copy_either(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    sim = Sim(tmp_path, "ttl-local")
    gw = gateway(tmp_path, "ttl-local", sim, redis_server.url, "ttl-local",
                 '[degraded]\ncache_ttl = 1.0\nstatic_message = "later"\n')
    try:
        assert httpx.post(gw.url + CHAT, json=ASKED).status_code == 200
        (key,) = wait_for(lambda: reply_keys(redis_server, "ttl-local"), 5, "the reply: key")
        no_backend(gw, sim)
        wait_for(lambda: not redis_server.client().exists(key), 5, "the entry to expire")
        assert httpx.post(gw.url + CHAT, json=ASKED).headers["x-gateway-degraded"] == "static"
    finally:
        gw.stop()
        sim.stop()
