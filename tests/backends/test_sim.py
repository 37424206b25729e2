"""The simulator as a real process, spoken to directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import Sim

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
    assert len(events) == 3 and '"error"' in events[-1]
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
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
