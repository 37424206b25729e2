"""A backend that writes its SSE stream in pieces of any size (the simulator's ``split``):
the client sees the same events as directly from the backend, with and without the
model-name rewrite (issue 19: a stream split at arbitrary byte boundaries)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import Gateway, Sim, backend_toml, http_ok, metric, wait_for

VOLATILE = ("id", "created", "system_fingerprint")


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Sim]:
    backend = Sim(tmp, "split", "--model", "served-name")
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def gw(tmp: Path, sim: Sim) -> Iterator[Gateway]:
    gateway = Gateway(tmp, '[[models]]\nname = "alias-longer-name"\n'
                      'groups = { stable = "served-name" }\n' + backend_toml("a", sim.url),
                      name="splits")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 20, "gateway ready")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def injecting(tmp: Path, sim: Sim) -> Iterator[Gateway]:
    """Asks for the usage chunk the client did not, and takes it out again."""
    gateway = Gateway(tmp, '[accounting]\nstream_usage = "inject"\n[[models]]\n'
                      'name = "alias-longer-name"\ngroups = { stable = "served-name" }\n'
                      + backend_toml("a", sim.url), name="injecting")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 20, "gateway ready")
    yield gateway
    gateway.stop()


def events(url: str, model: str, split: int, tokens: int, usage: bool = True) -> list[Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": tokens,
                            "messages": [{"role": "user", "content": "hello"}]}
    if usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20,
                      headers={"x-sim": f"split={split}"}) as reply:
        assert reply.status_code == 200
        raw = b"".join(reply.iter_raw())
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[6:]
        if data == "[DONE]":
            out.append(data)
            continue
        event = json.loads(data)
        out.append({k: v for k, v in event.items() if k not in VOLATILE})
    return out


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(split=st.integers(min_value=1, max_value=97), tokens=st.integers(1, 12))
def test_any_split_gives_the_client_the_direct_events(gw: Gateway, sim: Sim, split: int,
                                                      tokens: int) -> None:
    direct = events(sim.url, "served-name", split, tokens)
    assert direct[-1] == "[DONE]" and len(direct) >= tokens + 2
    assert events(gw.url, "served-name", split, tokens) == direct
    renamed = [e if e == "[DONE]" else {**e, "model": "alias-longer-name"} for e in direct]
    assert events(gw.url, "alias-longer-name", split, tokens) == renamed


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(split=st.integers(min_value=1, max_value=97), tokens=st.integers(1, 12))
def test_an_injected_usage_chunk_is_taken_out_at_any_split_and_counted(
        injecting: Gateway, sim: Sim, split: int, tokens: int) -> None:
    direct = events(sim.url, "served-name", split, tokens, usage=False)
    before = metric(injecting.url, "gateway_tokens_total", model="alias-longer-name",
                    kind="completion")
    renamed = [e if e == "[DONE]" else {**e, "model": "alias-longer-name"} for e in direct]
    assert events(injecting.url, "alias-longer-name", split, tokens, usage=False) == renamed
    after = metric(injecting.url, "gateway_tokens_total", model="alias-longer-name",
                   kind="completion")
    assert after - before == tokens


def test_an_aliased_stream_that_asked_for_usage_is_counted(gw: Gateway) -> None:
    before = metric(gw.url, "gateway_tokens_total", model="alias-longer-name",
                    kind="completion")
    events(gw.url, "alias-longer-name", 0, 5)
    after = metric(gw.url, "gateway_tokens_total", model="alias-longer-name", kind="completion")
    assert after - before == 5
