"""API keys, body limits, phase timeouts and honest failures, on a strict gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, wait_for

CHAT = "/v1/chat/completions"
KEY = "gw-key-1"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def strict(tmp: Path, sims: tuple[Sim, Sim]) -> Iterator[Gateway]:
    a, _ = sims
    config = (
        'api_keys = ["env:TEST_GW_KEY", "second-key"]\nmax_body_bytes = 2048\n'
        "[upstream]\nfirst_byte_timeout = 1.0\nidle_timeout = 1.0\n"
        "[health]\ninterval = 0.5\n" + backend_toml("a", a.url)
    )
    gw = Gateway(tmp, config, name="strict", env={"TEST_GW_KEY": KEY})
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "strict gateway ready")
    yield gw
    gw.stop()


def sdk(gw: Gateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_api_keys(strict: Gateway) -> None:
    assert sdk(strict).models.list().data[0].id == "sim-model"
    assert sdk(strict, "second-key").models.list().data[0].id == "sim-model"
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(strict, "wrong").chat.completions.create(model="sim-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "invalid_api_key"
    assert KEY not in str(info.value.body) and "wrong" not in str(info.value.body)
    assert httpx.get(strict.url + "/v1/models").status_code == 401
    assert httpx.get(strict.url + "/healthz").status_code == 200  # probes need no key


def test_open_gateway_says_so_once(gateway: Gateway, strict: Gateway) -> None:
    assert gateway.proc.output().count("the gateway is open") == 1
    assert "the gateway is open" not in strict.proc.output()


def test_secrets_never_reach_the_logs(strict: Gateway, gateway: Gateway,
                                      sims: tuple[Sim, Sim]) -> None:
    sdk(strict).chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert KEY not in strict.proc.output()
    # other-model is served by b only: this request carries b's key upstream.
    sdk(gateway).chat.completions.create(model="other-model", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert ("authorization", "Bearer backend-secret-b") in map(tuple, sims[1].stats()[
        "last_headers"])
    assert "backend-secret-b" not in gateway.proc.output()


def test_body_over_the_limit_is_413(strict: Gateway) -> None:
    big = [{"role": "user", "content": "x" * 4000}]
    with pytest.raises(openai.APIStatusError) as info:
        sdk(strict).chat.completions.create(model="sim-model", messages=big)  # type: ignore[arg-type]
    assert info.value.status_code == 413
    assert sdk(strict).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=1  # type: ignore[arg-type]
    ).choices[0].message.content == " tok0"


def test_no_first_byte_in_time_is_504(strict: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        sdk(strict).chat.completions.create(
            model="sim-model", messages=MESSAGES, extra_headers={"x-sim": "ttft=5"}  # type: ignore[arg-type]
        )
    assert info.value.status_code == 504


def _stream_text(gw: Gateway, fault: str) -> str:
    stream = sdk(gw).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=10, stream=True,  # type: ignore[arg-type]
        extra_headers={"x-sim": fault},
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.mark.parametrize("fault", ["fault=crash,after=3", "fault=stall,after=3",
                                   "fault=inband,after=3"])
def test_a_stream_that_fails_midway_raises_in_the_sdk(strict: Gateway, fault: str) -> None:
    with pytest.raises(openai.APIError):
        _stream_text(strict, fault)


def test_a_failed_stream_ends_with_one_error_event_and_no_done(strict: Gateway) -> None:
    resp = httpx.post(strict.url + CHAT, headers={"Authorization": f"Bearer {KEY}",
                                                  "x-sim": "fault=crash,after=3"},
                      json={"model": "sim-model", "stream": True, "messages": MESSAGES})
    events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert '"error"' in events[-1] and "mid-stream" in events[-1]
    assert sum('"error"' in e for e in events) == 1
    assert "data: [DONE]" not in resp.text
    assert len(events) == 4  # three good chunks, then the error


def test_backend_5xx_reaches_the_client_and_the_gateway_stays_up(strict: Gateway) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        sdk(strict).chat.completions.create(
            model="sim-model", messages=MESSAGES, extra_headers={"x-sim": "fault=500"}  # type: ignore[arg-type]
        )
    assert info.value.status_code == 500
    assert http_ok(strict.url + "/healthz")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_no_library_default_timeout_survives(tmp: Path, sims: tuple[Sim, Sim], client: str) -> None:
    """Libraries default to 5 s per phase; a 6 s first token and a 6 s gap must pass."""
    a, _ = sims
    gw = Gateway(tmp, f'[upstream]\nclient = "{client}"\n' + backend_toml("a", a.url),
                 name=f"defaults-{client}")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        stream = sdk(gw).chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=2, stream=True,  # type: ignore[arg-type]
            extra_headers={"x-sim": "ttft=6,itl=6"}, timeout=60,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == " tok0 tok1"
    finally:
        gw.stop()
