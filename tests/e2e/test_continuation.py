"""A stream whose backend fails after it began is finished on another backend, from exactly
where the client is: simulators whose tokens carry their sequence numbers (`` tok0 tok1...``),
the first one crashing after k events for every k, the official OpenAI SDK as the client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, http_ok, metric, wait_for

TOKENS = 8
WHOLE = "".join(f" tok{i}" for i in range(TOKENS))


@pytest.fixture(scope="module")
def pair(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    first, second = Sim(tmp, "cont-a", "--model", "m"), Sim(tmp, "cont-b", "--model", "m")
    yield first, second
    first.stop()
    second.stop()


def gateway(tmp: Path, pair: tuple[Sim, Sim], name: str, extra: str = "",
            breaker: bool = False) -> Gateway:
    first, second = pair
    config = (f"{extra}\n[health]\ninterval = 0.3\nrise = 1\n"
              f"[breaker]\nenabled = {str(breaker).lower()}\n"
              f'[[backends]]\nname = "a"\nurl = "{first.url}"\nweight = 1000\n'
              f'[[backends]]\nname = "b"\nurl = "{second.url}"\nweight = 1\n')
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    return gw


@pytest.fixture(scope="module")
def gw(tmp: Path, pair: tuple[Sim, Sim]) -> Iterator[Gateway]:
    gateway_ = gateway(tmp, pair, "cont")
    yield gateway_
    gateway_.stop()


def crash_after(sim: Sim, events: int | None) -> None:
    fault(sim, "" if events is None else f"fault=crash,after={events}")


def fault(sim: Sim, spec: str) -> None:
    assert httpx.post(sim.url + "/sim/fault", json={"set": spec}).status_code == 200


def backend(gw: Gateway, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(b for b in httpx.get(gw.url + "/admin/status").json()[
        "backends"] if b["name"] == name)
    return found


def chat(gw: Gateway, **extra: object) -> tuple[str, set[str], object]:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    text, ids, usage = [], set(), None
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "count"}], max_tokens=TOKENS,
        stream=True, **{"temperature": 0, **extra})  # type: ignore[call-overload]
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text), ids, usage


def complete(gw: Gateway) -> tuple[str, set[str]]:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    text, ids = [], set()
    for chunk in client.completions.create(model="m", prompt="count", max_tokens=TOKENS,
                                           temperature=0, stream=True):
        ids.add(chunk.id)
        text.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(text), ids


def test_a_chat_stream_broken_after_any_event_ends_whole_and_once(
    gw: Gateway, pair: tuple[Sim, Sim],
) -> None:
    before = metric(gw.url, "gateway_stream_continuations_total", outcome="completed")
    try:
        for k in range(TOKENS + 2):  # the headers only, the role chunk, each token
            crash_after(pair[0], k)
            text, ids, usage = chat(gw, stream_options={"include_usage": True})
            assert text == WHOLE, k
            assert len(ids) == 1, (k, ids)  # one stream, one id
            if k <= TOKENS:
                assert usage is not None and usage.completion_tokens == TOKENS, (k, usage)
            else:  # broke after the last token, before the usage: [DONE] ends it, no usage
                assert usage is None
    finally:
        crash_after(pair[0], None)
    assert metric(gw.url, "gateway_stream_continuations_total",
                  outcome="completed") - before == TOKENS + 2
    log = gw.proc.output()
    assert "stream continued a -> b at char 0 (token 0)" in log
    assert f"stream continued a -> b at char {len(WHOLE) - 5} (token {TOKENS - 1})" in log


def test_a_stream_broken_around_its_done_ends_whole_without_an_error(
    gw: Gateway, pair: tuple[Sim, Sim],
) -> None:
    """Broken after the usage chunk the client still needs [DONE] (sent by the gateway, a
    continuation that asks nothing); broken after [DONE] the stream is whole as it is."""
    before = metric(gw.url, "gateway_stream_continuations_total", outcome="completed")
    try:
        for k in (TOKENS + 2, TOKENS + 3):  # before [DONE], after it
            crash_after(pair[0], k)
            text, ids, usage = chat(gw, stream_options={"include_usage": True})
            assert text == WHOLE and len(ids) == 1, k
            assert usage is not None and usage.completion_tokens == TOKENS, k
    finally:
        crash_after(pair[0], None)
    assert metric(gw.url, "gateway_stream_continuations_total",
                  outcome="completed") - before == 1
    assert "not continued: done" not in gw.proc.output()


def test_the_failed_backend_does_not_count_the_request_while_another_finishes_it(
    gw: Gateway, pair: tuple[Sim, Sim],
) -> None:
    crash_after(pair[0], 2)
    fault(pair[1], "itl=0.2")
    seen: list[tuple[int, int]] = []
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        for chunk in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "count"}], max_tokens=TOKENS,
                temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content == " tok3":  # from b
                seen.append((backend(gw, "a")["in_flight"], backend(gw, "b")["in_flight"]))
    finally:
        crash_after(pair[0], None)
        fault(pair[1], "")
    assert seen == [(0, 1)]


def test_a_continuation_refused_for_its_request_is_not_the_backends_failure(
    tmp_path: Path, pair: tuple[Sim, Sim],
) -> None:
    """The other backend refuses the continuation itself (here: its prompt, the original
    and the text so far, is over that backend's limit: a 400). The client gets the error
    event; that backend's breaker is not charged, and no third backend would be asked."""
    gw = gateway(tmp_path, pair, "cont-refused", breaker=True)
    crash_after(pair[0], 3)
    fault(pair[1], "max_prompt_len=10")  # "count" passes, "count tok0 tok1 tok2" does not
    try:
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            complete(gw)
        assert backend(gw, "b")["breaker"]["failures"] == 0
        assert backend(gw, "a")["breaker"]["failures"] == 1
        assert "stream not continued: the continuation was refused (status 400)" in (
            gw.proc.output())
        assert metric(gw.url, "gateway_stream_continuations_total", outcome="declined") == 1
    finally:
        crash_after(pair[0], None)
        fault(pair[1], "")
        gw.stop()


def test_a_completion_stream_broken_after_any_event_ends_whole_and_once(
    gw: Gateway, pair: tuple[Sim, Sim],
) -> None:
    try:
        for k in range(TOKENS):
            crash_after(pair[0], k)
            text, ids = complete(gw)
            assert text == WHOLE and len(ids) == 1, (k, text, ids)
    finally:
        crash_after(pair[0], None)


def test_the_session_pin_moves_to_the_backend_that_finished(
    gw: Gateway, pair: tuple[Sim, Sim],
) -> None:
    session = {"x-session-id": "continued-session"}
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(gw.url + "/v1/chat/completions", json=body,
                      headers=session).headers["x-gateway-backend"] == "a"
    crash_after(pair[0], 3)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                               default_headers=session)
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=TOKENS,
            temperature=0, stream=True) if c.choices)
        assert text == WHOLE
    finally:
        crash_after(pair[0], None)
    assert httpx.post(gw.url + "/v1/chat/completions", json=body,
                      headers=session).headers["x-gateway-backend"] == "b"


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": True}, {"temperature": 0.7},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
], ids=["n", "logprobs", "sampled", "structured", "tools"])
def test_what_cannot_be_continued_still_ends_with_an_error_event(
    gw: Gateway, pair: tuple[Sim, Sim], extra: dict[str, object],
) -> None:
    crash_after(pair[0], 3)
    try:
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            chat(gw, **extra)
    finally:
        crash_after(pair[0], None)


def test_off_ends_with_an_error_event(tmp_path: Path, pair: tuple[Sim, Sim]) -> None:
    off = gateway(tmp_path, pair, "cont-off", "[resilience]\ncontinue_streams = \"off\"\n")
    crash_after(pair[0], 3)
    try:
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            chat(off)
    finally:
        crash_after(pair[0], None)
        off.stop()


def test_always_continues_a_sampled_stream(tmp_path: Path, pair: tuple[Sim, Sim]) -> None:
    always = gateway(tmp_path, pair, "cont-always", "[resilience]\ncontinue_streams = "
                     "\"always\"\n")
    crash_after(pair[0], 4)
    try:
        text, ids, _ = chat(always, temperature=0.9)
        assert text == WHOLE and len(ids) == 1
    finally:
        crash_after(pair[0], None)
        always.stop()
