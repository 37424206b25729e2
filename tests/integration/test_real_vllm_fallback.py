"""The fallback model in front of real vLLM, two genuinely different models: a second gateway
whose model "big" is the package fixture's tiny model (one of its instances, by url) and
whose model "small" is another model, smaller and with other weights, that this gateway
spawns itself. With big's instance drained, big's requests are answered by small's
instance, marked and named as small, with small's own text, streamed and not, in vLLM's own
bytes (only ``model`` rewritten)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, http_ok, wait_for
from tests.integration.vllm_setup import SMALL, STARTUP, status, vllm_backend

pytestmark = pytest.mark.timeout(2 * STARTUP + 300)


def test_the_small_model_answers_for_the_big_one(gw: Gateway, tmp_path: Path) -> None:
    if not (SMALL / "model.safetensors").exists():
        pytest.fail("build models/tiny-llama-small first (scripts/prepare_vllm.sh does)")
    wait_for(lambda: all(b["state"] == "ready" for b in status(gw).values()), STARTUP,
             "both instances ready", every=1.0)
    config = ('[health]\ninterval = 0.5\nrise = 1\n[degraded]\ncache = false\n'
              f'[supervisor]\nlog_dir = "{tmp_path / "logs"}"\n'
              '[[models]]\nname = "big"\ngroups = { large = "tiny-llama" }\nfallback = "small"\n'
              '[[models]]\nname = "small"\ngroups = { lite = "tiny-small" }\n'
              f'[[backends]]\nname = "big0"\nurl = "{status(gw)["v1"]["url"]}"\n'
              'group = "large"\n'
              + vllm_backend("small0", 1, SMALL, "tiny-small").replace(
                  "[backends.spawn]", 'group = "lite"\n[backends.spawn]'))
    front = Gateway(tmp_path, config, name="vllm-fallback")
    try:
        wait_for(lambda: http_ok(front.url + "/readyz") and all(
            b["state"] == "ready" for b in status(front).values()), STARTUP,
            "front gateway and the small model's instance ready", every=1.0)
        api = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                            timeout=120)
        ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
               "temperature": 0}
        big = api.chat.completions.with_raw_response.create(model="big", **ask)
        assert big.headers["x-gateway-backend"] == "big0"
        assert big.parse().model == "big"
        small = api.chat.completions.with_raw_response.create(model="small", **ask)
        assert small.headers["x-gateway-backend"] == "small0"
        assert "x-gateway-degraded" not in small.headers
        small_text = small.parse().choices[0].message.content
        assert small_text and small_text != big.parse().choices[0].message.content

        drained = httpx.post(front.url + "/admin/backends/big0/drain", json={"timeout": 30})
        assert drained.status_code == 200
        raw = api.chat.completions.with_raw_response.create(model="big", **ask)
        assert raw.headers["x-gateway-degraded"] == "fallback"
        assert raw.headers["x-gateway-backend"] == "small0"
        reply = raw.parse()
        assert reply.model == "small" and reply.choices[0].message.content == small_text
        with api.chat.completions.with_streaming_response.create(
                model="big", stream=True, **ask) as stream:
            assert stream.headers["x-gateway-degraded"] == "fallback"
            chunks = list(stream.parse())
        assert {c.model for c in chunks} == {"small"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            small_text
    finally:
        front.stop()
