"""The official openai SDK, sync and async, streaming and not, through the real gateway."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim

MESSAGES = [{"role": "user", "content": "hello"}]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming(gateway: Gateway) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="sim-model", messages=MESSAGES, max_tokens=4  # type: ignore[arg-type]
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == " tok0 tok1 tok2 tok3"
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert raw.headers["x-gateway-backend"] in ("a", "b")
    assert raw.headers["x-gateway-group"] == "stable"
    assert raw.headers["x-request-id"]


def test_chat_streaming_with_usage(gateway: Gateway) -> None:
    stream = client(gateway).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok0 tok1 tok2 tok3 tok4"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_text_completion(gateway: Gateway) -> None:
    reply = client(gateway).completions.create(model="sim-model", prompt="once", max_tokens=2)
    assert reply.choices[0].text == " tok0 tok1"


def test_embeddings(gateway: Gateway) -> None:
    reply = client(gateway).embeddings.create(model="sim-model", input=["a", "b"])
    assert [d.index for d in reply.data] == [0, 1]
    assert len(reply.data[0].embedding) == 8


def test_models_is_the_union_and_survives_a_dead_backend(gateway: Gateway) -> None:
    ids = sorted(m.id for m in client(gateway).models.list())
    assert ids == ["other-model", "sim-model"]


def test_models_retrieve_answers_a_known_model_and_404s_an_unknown_one(gateway: Gateway) -> None:
    assert client(gateway).models.retrieve("sim-model").id == "sim-model"
    with pytest.raises(openai.NotFoundError) as info:
        client(gateway).models.retrieve("nope")
    assert info.value.code == "model_not_found"


def test_unknown_paths_and_methods_are_openai_format_errors(gateway: Gateway) -> None:
    """What the gateway answers itself, 404 and 405 included: JSON in the OpenAI format."""
    with httpx.Client(base_url=gateway.url) as http:
        for method, path, status in (("GET", "/v1/nowhere", 404), ("POST", "/nope", 404),
                                     ("DELETE", "/v1/models", 405),
                                     ("GET", "/v1/chat/completions", 405)):
            reply = http.request(method, path)
            assert reply.status_code == status, (method, path)
            assert reply.headers["content-type"].startswith("application/json")
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
            assert error["code"] == ("not_found" if status == 404 else "method_not_allowed")


def test_health_and_version_answer_as_vllm_does(gateway: Gateway) -> None:
    """GuideLLM's backend check (0.8.1, ``OpenAIHTTPBackend.validate``/``default_model``):
    ``GET /health`` must be 2xx or it refuses to send load; without a model named it takes
    the first id of ``GET /v1/models``. (GuideLLM itself needs CUDA torch, 6 GB: it ran
    here once by hand, 3 of 3 requests through the gateway; README "Tools".)"""
    with httpx.Client(base_url=gateway.url) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.content == b""
        assert http.get("/v1/models").json()["data"][0]["id"] == "other-model"
        assert http.get("/version").json()["version"]


def test_tokenize_and_detokenize_are_proxied_as_vllm_answers_them(
        gateway: Gateway, sims: tuple[Sim, Sim]) -> None:
    """vLLM's routes outside /v1/: the same routing by model, the backend's bytes back."""
    body = {"model": "sim-model", "prompt": "one two three"}
    with httpx.Client() as http:
        through = http.post(gateway.url + "/tokenize", json=body)
        direct = http.post(sims[0].url + "/tokenize", json=body)
        assert through.status_code == 200 and through.content == direct.content
        assert through.headers["x-gateway-backend"] in ("a", "b")
        tokens = through.json()["tokens"]
        back = http.post(gateway.url + "/detokenize", json={"model": "sim-model",
                                                            "tokens": tokens})
        assert back.status_code == 200
        assert back.content == http.post(sims[0].url + "/detokenize", json={
            "model": "sim-model", "tokens": tokens}).content
        assert http.post(gateway.url + "/tokenize", json={"model": "nope", "prompt": "x"}
                         ).json()["error"]["code"] == "model_not_found"


def test_model_served_by_one_backend_only_goes_there(gateway: Gateway) -> None:
    for _ in range(4):
        raw = client(gateway).chat.completions.with_raw_response.create(
            model="other-model", messages=MESSAGES, max_tokens=1  # type: ignore[arg-type]
        )
        assert raw.headers["x-gateway-backend"] == "b"


def test_unknown_model_is_a_404_in_openai_format(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gateway).chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"


def test_async_client_streams_concurrently(gateway: Gateway) -> None:
    async def one(ac: openai.AsyncOpenAI, i: int) -> str:
        stream = await ac.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=3, stream=True,  # type: ignore[arg-type]
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        async with ac:
            return await asyncio.gather(*(one(ac, i) for i in range(20)))

    assert asyncio.run(main()) == [" tok0 tok1 tok2"] * 20


def test_async_non_streaming(gateway: Gateway) -> None:
    async def main() -> str | None:
        ac = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        async with ac:
            reply = await ac.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=2  # type: ignore[arg-type]
            )
            return reply.choices[0].message.content

    assert asyncio.run(main()) == " tok0 tok1"


def test_dead_backend_is_skipped_and_ties_rotate(gateway: Gateway, sims: tuple[Sim, Sim]) -> None:
    seen = []
    for _ in range(10):
        raw = client(gateway).chat.completions.with_raw_response.create(
            model="sim-model", messages=MESSAGES, max_tokens=1  # type: ignore[arg-type]
        )
        seen.append(raw.headers["x-gateway-backend"])
    assert "dead" not in seen
    # Sequential requests leave both idle, so the tie rotates between them.
    assert seen.count("a") == 5 and seen.count("b") == 5


def test_without_a_model_a_gateway_serving_several_answers_400(gateway: Gateway) -> None:
    reply = httpx.post(gateway.url + "/v1/chat/completions", json={"messages": MESSAGES},
                       timeout=10)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model" and "serves 2 models" in error["message"]
