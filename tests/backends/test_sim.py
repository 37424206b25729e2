"""The simulator as a real process, spoken to directly."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Sim

CHAT = "/v1/chat/completions"


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = Sim(tmp_path_factory.mktemp("sim"), "direct", "--max-prompt-len", "4000")
    yield s
    s.stop()


def metric(sim: Sim, name: str) -> float:
    for line in httpx.get(sim.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_metrics_have_vllm_names(sim: Sim) -> None:
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        metric(sim, name)


def test_prefix_cache_hits_grow_with_a_shared_history(sim: Sim) -> None:
    history = "a long shared system prompt " * 20
    hits = metric(sim, "vllm:prefix_cache_hits_total")
    httpx.post(sim.url + CHAT, json=chat(history + "turn one"))
    assert metric(sim, "vllm:prefix_cache_hits_total") == hits
    httpx.post(sim.url + CHAT, json=chat(history + "turn two"))
    assert metric(sim, "vllm:prefix_cache_hits_total") - hits >= len(history) - 32


def test_busy_carries_retry_after(sim: Sim) -> None:
    resp = httpx.post(sim.url + CHAT, json=chat("x"), headers={"x-sim": "fault=busy,retry_after=7"})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "7"


def test_prompt_over_the_limit_is_400(sim: Sim) -> None:
    resp = httpx.post(sim.url + CHAT, json=chat("x" * 5000))
    assert resp.status_code == 400
    assert "maximum context length" in resp.json()["error"]["message"]


def test_crash_drops_the_connection_mid_stream(sim: Sim) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(sim.url + CHAT, json=chat("x", stream=True, max_tokens=10),
                   headers={"x-sim": "fault=crash,after=2"})


def test_inband_error_inside_a_200_stream(sim: Sim) -> None:
    resp = httpx.post(sim.url + CHAT, json=chat("x", stream=True, max_tokens=10),
                      headers={"x-sim": "fault=inband,after=2"})
    assert resp.status_code == 200
    events = [e for e in resp.text.split("\n\n") if e]
    assert len(events) == 3 and events[-1].startswith('data: {"error": {"message": ')
    assert "[DONE]" not in resp.text


def test_stall_then_nothing(sim: Sim) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url + CHAT, json=chat("x", stream=True),
                   headers={"x-sim": "fault=stall,after=1"}, timeout=0.5)


def test_error_rate_one_is_always_500(tmp_path: Path) -> None:
    s = Sim(tmp_path, "failing", "--error-rate", "1.0")
    try:
        assert httpx.post(s.url + CHAT, json=chat("x")).status_code == 500
    finally:
        s.stop()


def test_completion_usage_and_text(sim: Sim) -> None:
    resp = httpx.post(sim.url + "/v1/completions",
                      json={"model": "sim-model", "prompt": "abcd", "max_tokens": 3})
    body = resp.json()
    assert body["choices"][0]["text"] == " tok0 tok1 tok2"
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_whole_replies_carry_their_length_and_compact_json(sim: Sim) -> None:
    for path, body in ((CHAT, chat("x")), ("/v1/embeddings", {"model": "sim-model", "input": "a"}),
                       ("/tokenize", {"model": "sim-model", "prompt": "ab"})):
        with httpx.stream("POST", sim.url + path, json=body) as resp:
            raw = b"".join(resp.iter_raw())
        assert resp.headers["content-length"] == str(len(raw)), path
        assert "transfer-encoding" not in resp.headers
        assert raw.startswith(b'{"') and b'": ' not in raw and b'", "' not in raw


def test_base64_embeddings_are_little_endian_float32(sim: Sim) -> None:
    def embed(fmt: str) -> list[object]:
        body = {"model": "sim-model", "input": ["one", "two"], "encoding_format": fmt}
        reply = httpx.post(sim.url + "/v1/embeddings", json=body).json()
        return [d["embedding"] for d in reply["data"]]

    for vector, packed in zip(embed("float"), embed("base64"), strict=True):
        assert isinstance(vector, list) and isinstance(packed, str)
        raw = base64.b64decode(packed)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector
    assert embed("float")[0] != embed("float")[1]


def test_unknown_model_is_404_and_a_missing_one_the_first_served(sim: Sim) -> None:
    resp = httpx.post(sim.url + CHAT, json=chat("x", model="not-served"))
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": "The model `not-served` does not exist. Valid aliases: sim-model.",
        "type": "NotFoundError", "param": "model", "code": 404}
    body = chat("x")
    del body["model"]
    assert httpx.post(sim.url + CHAT, json=body).json()["model"] == "sim-model"


def test_tokenize_and_detokenize_round_trip(sim: Sim) -> None:
    tokens = httpx.post(sim.url + "/tokenize", json={"model": "sim-model", "prompt": "hé"}).json()
    assert tokens["count"] == 3 and tokens["max_model_len"] == 4000
    text = httpx.post(sim.url + "/detokenize", json={"model": "sim-model",
                                                     "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hé"}
    assert httpx.get(sim.url + "/version").json() == {"version": "0.32.0"}


def test_cut_drops_a_whole_reply_after_its_headers(sim: Sim) -> None:
    with httpx.stream("POST", sim.url + CHAT, json=chat("x"),
                      headers={"x-sim": "fault=cut,after=10"}) as resp:
        assert resp.status_code == 200 and int(resp.headers["content-length"]) > 10
        received = bytearray()
        with pytest.raises(httpx.RemoteProtocolError):
            for piece in resp.iter_raw():
                received += piece
    assert len(received) == 10


def test_split_writes_events_in_pieces(sim: Sim) -> None:
    with httpx.stream("POST", sim.url + CHAT, json=chat("x", stream=True, max_tokens=3),
                      headers={"x-sim": "split=7"}) as resp:
        pieces = list(resp.iter_raw())
    whole = b"".join(pieces)
    assert max(len(p) for p in pieces) <= 7 < len(whole)
    events = whole.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 6


def test_a_fault_set_at_runtime_applies_until_it_is_cleared(tmp_path: Path) -> None:
    s = Sim(tmp_path, "runtime-fault")
    try:
        assert httpx.post(s.url + CHAT, json=chat("x")).status_code == 200
        set_ = httpx.post(s.url + "/sim/fault", json={"set": "fault=500"})
        assert set_.status_code == 200 and set_.json() == {"set": "fault=500"}
        assert httpx.post(s.url + CHAT, json=chat("x")).status_code == 500
        assert httpx.post(s.url + "/sim/fault", json={"set": ""}).status_code == 200
        assert httpx.post(s.url + CHAT, json=chat("x")).status_code == 200
        bad = httpx.post(s.url + "/sim/fault", json={"set": "nonsense=1"})
        assert bad.status_code == 400 and "nonsense" in bad.json()["error"]["message"]
        assert httpx.post(s.url + CHAT, json=chat("x")).status_code == 200
    finally:
        s.stop()
