"""vLLM's other routes through the gateway, with the official SDK where it has them: audio
uploads (multipart: the model from its form field, the body limit while it streams in),
rerank, score, pooling, Anthropic messages, and ``/v1/models`` with vLLM's own fields."""

from __future__ import annotations

import base64
import io
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, sim_group, wait_for

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[list[Sim]]:
    with sim_group(tmp, "routes", 2, "--max-prompt-len", "4000") as pair:
        yield pair


@pytest.fixture(scope="module")
def gateway(tmp: Path, sims: list[Sim]) -> Iterator[Gateway]:
    third = Sim(tmp, "short", "--max-prompt-len", "2000")
    config = (f"max_body_bytes = {LIMIT}\n[health]\ninterval = 0.3\n"
              + backend_toml("a", sims[0].url) + backend_toml("b", sims[1].url)
              + backend_toml("c", third.url))
    gw = Gateway(tmp, config)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    yield gw
    gw.stop()
    third.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_audio_transcription_and_translation_with_the_sdk(gateway: Gateway) -> None:
    audio = ("speech.wav", io.BytesIO(b"RIFF" + bytes(40_000)), "audio/wav")
    raw = client(gateway).audio.transcriptions.with_raw_response.create(
        model="sim-model", file=audio, language="en")
    assert raw.parse().text == " tok0 tok1 tok2 tok3"
    assert raw.headers["x-gateway-backend"] in ("a", "b", "c")
    translated = client(gateway).audio.translations.create(
        model="sim-model", file=("x.wav", b"RIFF" + bytes(100), "audio/wav"))
    assert translated.text == " tok0 tok1 tok2 tok3"


def test_an_upload_for_an_unknown_model_is_a_404_naming_it(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(gateway).audio.transcriptions.create(model="whisper-9", file=("a.wav", b"x"))
    assert "whisper-9" in caught.value.message


def _multipart(fields: dict[str, str], file: bytes) -> tuple[bytes, str]:
    boundary = "gwtestboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
             .encode() for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                 f'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'.encode() + file
                 + f"\r\n--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("fields, body, expected", [
    ({"model": "m" * (65 * 1024)}, None, "longer than"),
    ({"model": "sim-model"}, b"--nope\r\nnot multipart at all", "not valid multipart"),
])
def test_a_bad_upload_is_a_400_in_the_openai_format(
        gateway: Gateway, fields: dict[str, str], body: bytes | None, expected: str) -> None:
    built, content_type = _multipart(fields, b"RIFF")
    reply = httpx.post(gateway.url + "/v1/audio/transcriptions", content=body or built,
                       headers={"content-type": content_type}, timeout=10)
    assert reply.status_code in (400, 413), reply.text
    assert expected in reply.json()["error"]["message"]


def test_an_upload_over_the_body_limit_is_refused_while_it_streams_in(gateway: Gateway) -> None:
    body, content_type = _multipart({"model": "sim-model"}, bytes(4 * LIMIT))
    # Chunked, so no length is declared: the limit must hold while the bytes arrive.
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: " + content_type.encode()
                     + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        sent = 0
        try:
            for start in range(0, len(body), 8192):
                piece = body[start:start + 8192]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the rest came: the point
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"payload_too_large"' in reply
    assert http_ok(gateway.url + "/readyz")


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sent before it closed (headers and body may come apart)."""
    reply = b""
    while True:
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            return reply
        if not piece:
            return reply
        reply += piece


def test_rerank_score_and_pooling(gateway: Gateway) -> None:
    docs = ["paris is in france", "bananas are yellow"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = httpx.post(gateway.url + path, json={
            "model": "sim-model", "query": "where is paris", "documents": docs}, timeout=10)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert sorted(r["index"] for r in results) == [0, 1]
        assert reply.headers["x-gateway-backend"] in ("a", "b", "c")
    for path in ("/v1/score", "/score"):
        reply = httpx.post(gateway.url + path, json={
            "model": "sim-model", "text_1": "paris", "text_2": docs}, timeout=10)
        assert reply.status_code == 200 and reply.json()["object"] == "list"
        assert [d["object"] for d in reply.json()["data"]] == ["score", "score"]
    reply = httpx.post(gateway.url + "/pooling", json={"model": "sim-model", "input": ["a"]},
                       timeout=10)
    assert reply.status_code == 200 and reply.json()["data"][0]["object"] == "pooling"


def test_anthropic_messages(gateway: Gateway) -> None:
    reply = httpx.post(gateway.url + "/v1/messages", json={
        "model": "sim-model", "max_tokens": 3,
        "messages": [{"role": "user", "content": "hello"}]}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["text"] == " tok0 tok1 tok2"
    bad = httpx.post(gateway.url + "/v1/messages", json={"model": 7, "max_tokens": 3},
                     timeout=10)
    assert bad.status_code == 400 and "'model' is required" in bad.json()["error"]["message"]


def test_without_a_model_the_one_model_served_is_meant(gateway: Gateway) -> None:
    """As vLLM takes its own model when none is named (tools like GuideLLM rely on it)."""
    reply = httpx.post(gateway.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert reply.status_code == 200 and reply.json()["count"] == 2
    body, content_type = _multipart({}, b"RIFF")
    reply = httpx.post(gateway.url + "/v1/audio/transcriptions", content=body,
                       headers={"content-type": content_type}, timeout=10)
    assert reply.status_code == 200 and reply.json()["text"]


def test_models_keep_vllms_fields_merged_across_backends(gateway: Gateway) -> None:
    listed = client(gateway).models.list().data
    assert [m.id for m in listed] == ["sim-model"]
    card = client(gateway).models.retrieve("sim-model")
    extra = card.model_extra or {}
    assert card.owned_by == "vllm" and extra["root"] == "sim-model"
    assert extra["parent"] is None and extra["permission"][0]["object"] == "model_permission"
    # The smallest context any backend takes: a prompt that fits one fits them all.
    assert extra["max_model_len"] == 2000


def test_embeddings_in_base64_with_the_sdk(gateway: Gateway) -> None:
    # Without a format the SDK itself asks for base64 and decodes it to floats.
    decoded = client(gateway).embeddings.create(model="sim-model", input=["a", "b"])
    assert [len(d.embedding) for d in decoded.data] == [8, 8]
    raw = client(gateway).embeddings.create(model="sim-model", input=["a", "b"],
                                            encoding_format="base64")
    floats = [struct.unpack("<8f", base64.b64decode(str(d.embedding))) for d in raw.data]
    assert [list(f) for f in floats] == [d.embedding for d in decoded.data]


@pytest.mark.parametrize("method,path", [
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")])
def test_vllms_control_routes_are_never_forwarded(gateway: Gateway, sims: list[Sim],
                                                  method: str, path: str) -> None:
    """vLLM's dev routes (sleep, weights, caches) and adapter loading act on the instance
    for every tenant: a client's request for them is a 404 from the gateway itself, and no
    backend sees it."""
    before = [sim.stats()["requests"] for sim in sims]
    reply = httpx.request(method, gateway.url + path, params={"level": 2},
                          json={"method": "reload_weights"})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "not_found"  # the OpenAI error format
    assert [sim.stats()["requests"] for sim in sims] == before
