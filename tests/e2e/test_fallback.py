"""``[[models]] fallback``: when no backend of a model can answer, a smaller model served by
other backends does, after the reply cache and before the static message; marked
``X-Gateway-Degraded: fallback``, counted, named in the reply, and never for a key that may
not use the smaller model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, http_ok, metric, wait_for

ALICE = "sk-alice-only-big-0000000001"  # may use "big" only
BOB = "sk-bob-big-and-small-00000001"
CAROL = "sk-carol-one-a-minute-00000001"  # both models, one request a minute
CHAT = "/v1/chat/completions"
BODY = {"model": "big", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    big, small = Sim(tmp, "fb-big", "--model", "big"), Sim(tmp, "fb-small", "--model", "small")
    yield big, small
    big.stop()
    small.stop()


@pytest.fixture(scope="module")
def gw(tmp: Path, sims: tuple[Sim, Sim]) -> Iterator[Gateway]:
    big, small = sims
    config = ('[health]\ninterval = 0.3\nrise = 1\n[degraded]\nstatic_message = "later"\n'
              '[breaker]\nenabled = false\n'
              '[[models]]\nname = "big"\nfallback = "small"\n'
              f'[[keys]]\nname = "alice"\nkey = "{ALICE}"\nmodels = ["big"]\n'
              f'[[keys]]\nname = "bob"\nkey = "{BOB}"\nmodels = ["big", "small"]\n'
              f'[[keys]]\nname = "carol"\nkey = "{CAROL}"\nmodels = ["big", "small"]\n'
              'rpm = 1\n'
              f'[[backends]]\nname = "big0"\nurl = "{big.url}"\n'
              f'[[backends]]\nname = "small0"\nurl = "{small.url}"\n')
    gateway = Gateway(tmp, config, name="fallback")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 10, "gateway ready")
    yield gateway
    gateway.stop()


def fault(sim: Sim, spec: str) -> None:
    assert httpx.post(sim.url + "/sim/fault", json={"set": spec}).status_code == 200


def ask(gw: Gateway, key: str, **body: object) -> httpx.Response:
    return httpx.post(gw.url + CHAT, json={**BODY, **body},
                      headers={"authorization": f"Bearer {key}"})


def test_the_smaller_model_answers_when_the_big_one_cannot(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    before = metric(gw.url, "gateway_degraded_replies_total", kind="fallback")
    fault(sims[0], "fault=500")
    try:
        reply = ask(gw, BOB, messages=[{"role": "user", "content": "plain"}])
        assert reply.status_code == 200
        assert reply.headers["x-gateway-degraded"] == "fallback"
        assert reply.headers["x-gateway-backend"] == "small0"
        assert reply.json()["model"] == "small"  # who actually answered
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=BOB, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": "streamed"}], max_tokens=3,
            temperature=0, stream=True)
        assert raw.headers["x-gateway-degraded"] == "fallback"
        chunks = list(raw.parse())
        assert {c.model for c in chunks} == {"small"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finally:
        fault(sims[0], "")
    assert metric(gw.url, "gateway_degraded_replies_total", kind="fallback") - before == 2
    assert "model big answered by its fallback small" in gw.proc.output()


def test_a_key_that_may_not_use_the_fallback_gets_the_static_reply(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    small_before = httpx.get(sims[1].url + "/sim/stats").json()["started"]
    fault(sims[0], "fault=500")
    try:
        reply = ask(gw, ALICE, messages=[{"role": "user", "content": "alice"}])
    finally:
        fault(sims[0], "")
    assert reply.status_code == 200 and reply.headers["x-gateway-degraded"] == "static"
    assert reply.json()["choices"][0]["message"]["content"] == "later"
    assert reply.json()["model"] == "big"
    assert httpx.get(sims[1].url + "/sim/stats").json()["started"] == small_before


def test_the_cache_comes_first_and_the_static_reply_last(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    question = {"messages": [{"role": "user", "content": "asked before"}]}
    assert ask(gw, BOB, **question).headers.get("x-gateway-degraded") is None  # answered, kept
    fault(sims[0], "fault=500")
    try:
        wait_for(lambda: ask(gw, BOB, **question).headers.get("x-gateway-degraded") == "cache",
                 5, "the kept reply")
        fault(sims[1], "fault=500")
        reply = ask(gw, BOB, messages=[{"role": "user", "content": "never asked"}])
        assert reply.headers["x-gateway-degraded"] == "static"
        assert reply.json()["model"] == "big"
    finally:
        fault(sims[0], "")
        fault(sims[1], "")


def test_a_key_over_its_limit_is_refused_not_answered_by_the_fallback(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    fault(sims[0], "fault=500")
    try:
        first = ask(gw, CAROL, messages=[{"role": "user", "content": "carol 1"}])
        second = ask(gw, CAROL, messages=[{"role": "user", "content": "carol 2"}])
    finally:
        fault(sims[0], "")
    assert first.status_code == 200 and first.headers["x-gateway-degraded"] == "fallback"
    assert second.status_code == 429, second.text


def test_only_a_generation_is_answered_by_the_fallback(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    """Another model's embeddings are not a degraded answer: the client gets the failure."""
    small_before = httpx.get(sims[1].url + "/sim/stats").json()["started"]
    fault(sims[0], "fault=500")
    try:
        reply = httpx.post(gw.url + "/v1/embeddings", json={"model": "big", "input": "x"},
                           headers={"authorization": f"Bearer {BOB}"})
    finally:
        fault(sims[0], "")
    assert reply.status_code >= 500 and reply.headers.get("x-gateway-degraded") != "fallback"
    assert httpx.get(sims[1].url + "/sim/stats").json()["started"] == small_before


def test_the_fallbacks_attempts_count_on_in_the_log(
    gw: Gateway, sims: tuple[Sim, Sim],
) -> None:
    fault(sims[0], "fault=500")
    try:
        reply = httpx.post(gw.url + CHAT, json=BODY, headers={
            "authorization": f"Bearer {BOB}", "x-request-id": "fallback-attempts-1"})
    finally:
        fault(sims[0], "")
    assert reply.headers["x-gateway-degraded"] == "fallback"
    line = wait_for(lambda: next((x for x in gw.proc.output().splitlines()
                                  if "fallback-attempts-1" in x and "status" in x), None),
                    5, "the access log line")
    assert "attempts=2" in line or '"attempts":2' in line, line
