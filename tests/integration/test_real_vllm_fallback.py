"""The fallback model in front of real vLLM: a second gateway whose model "big" is served by
one vLLM instance of the package fixture and "small" by the other (both the tiny model, under
the names this gateway gives them with ``[[models]] groups``). With big's instance drained,
its requests are answered by small's, marked and named as small, streamed and not, in vLLM's
own bytes (only ``model`` rewritten)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, http_ok, wait_for
from tests.integration.vllm_setup import STARTUP, status

pytestmark = pytest.mark.timeout(STARTUP + 300)


def test_the_small_model_answers_for_the_big_one(gw: Gateway, tmp_path: Path) -> None:
    wait_for(lambda: all(b["state"] == "ready" for b in status(gw).values()), STARTUP,
             "both instances ready", every=1.0)
    urls = {name: b["url"] for name, b in status(gw).items()}
    config = ('[health]\ninterval = 0.5\nrise = 1\n[degraded]\ncache = false\n'
              '[[models]]\nname = "big"\ngroups = { large = "tiny-llama" }\nfallback = "small"\n'
              '[[models]]\nname = "small"\ngroups = { lite = "tiny-llama" }\n'
              f'[[backends]]\nname = "big0"\nurl = "{urls["v1"]}"\ngroup = "large"\n'
              f'[[backends]]\nname = "small0"\nurl = "{urls["v2"]}"\ngroup = "lite"\n')
    front = Gateway(tmp_path, config, name="vllm-fallback")
    try:
        wait_for(lambda: http_ok(front.url + "/readyz") and all(
            b["state"] == "ready" for b in status(front).values()), 60, "front gateway ready")
        api = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                            timeout=120)
        ask = {"model": "big", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 8, "temperature": 0}
        direct = api.chat.completions.with_raw_response.create(**ask)
        assert direct.headers["x-gateway-backend"] == "big0"
        assert direct.parse().model == "big"
        drained = httpx.post(front.url + "/admin/backends/big0/drain", json={"timeout": 30})
        assert drained.status_code == 200
        raw = api.chat.completions.with_raw_response.create(**ask)
        assert raw.headers["x-gateway-degraded"] == "fallback"
        assert raw.headers["x-gateway-backend"] == "small0"
        reply = raw.parse()
        assert reply.model == "small" and reply.choices[0].message.content
        assert reply.choices[0].message.content == direct.parse().choices[0].message.content
        with api.chat.completions.with_streaming_response.create(**ask, stream=True) as stream:
            assert stream.headers["x-gateway-degraded"] == "fallback"
            chunks = list(stream.parse())
        assert {c.model for c in chunks} == {"small"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            reply.choices[0].message.content
    finally:
        front.stop()
