"""vLLM's other routes through the gateway, against real vLLM: the Responses API with its
per-instance store (two instances, ``VLLM_ENABLE_RESPONSES_API_STORE=1``), models by id,
and Anthropic messages. The gateway is the package fixture ``gw`` (the default config with
spawned instances); the unpinned one has the same two instances as url backends."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_supervision import descendants
from tests.helpers import Gateway, backend_toml, http_ok, metric, wait_for
from tests.integration.vllm_setup import STARTUP, status

pytestmark = pytest.mark.timeout(STARTUP + 300)

CONVERSATIONS = 20
DONE = ("completed", "incomplete")


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def conversations(gw: Gateway) -> tuple[int, list[str]]:
    """20 two-turn conversations, each turn two continuing the first with
    ``previous_response_id`` and ``store`` on: how many succeed, and the failures."""
    client, ok, failures = sdk(gw), 0, []
    for i in range(CONVERSATIONS):
        first = client.responses.create(model="tiny-llama", input=f"hello number {i}",
                                        max_output_tokens=4, store=True)
        try:
            second = client.responses.create(model="tiny-llama", input="go on",
                                             previous_response_id=first.id,
                                             max_output_tokens=4, store=True)
        except openai.APIStatusError as exc:
            failures.append(f"{exc.status_code}: {exc.message[:120]}")
            continue
        # "incomplete": it stopped at max_output_tokens, as asked.
        ok += second.previous_response_id == first.id and second.status in DONE
    return ok, failures


@pytest.fixture(scope="module")
def unpinned(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The same two instances, the default config but ``pin_responses = false``."""
    backends = "".join(backend_toml(b, s["url"]) for b, s in sorted(status(gw).items()))
    gateway = Gateway(tmp_path_factory.mktemp("unpinned"),
                      "[routing]\npin_responses = false\n[health]\ninterval = 0.5\n" + backends,
                      name="unpinned")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 30, "unpinned ready")
    yield gateway
    gateway.stop()


def test_twenty_two_turn_conversations_all_succeed_through_the_gateway(gw: Gateway) -> None:
    mark = len(gw.proc.output())
    ok, failures = conversations(gw)
    print(f"\nresponses, pinned (default config): {ok}/{CONVERSATIONS} succeeded")
    # What the gateway said meanwhile, beyond its access lines: why a follow-up went astray.
    said = [line for line in gw.proc.output()[mark:].splitlines()
            if '"level":"info"' not in line][-20:]
    assert (ok, failures) == (CONVERSATIONS, []), said


def test_conversations_survive_a_redis_that_stops_answering(gw: Gateway) -> None:
    """The embedded valkey SIGSTOPped for the whole run: no record of where a response is
    stored reaches Redis, and no lookup is answered; the serving process remembers the
    responses it made, so every follow-up still reaches its instance (before that memory,
    CI saw 19 of 20 follow-ups answered 404 by the other instance after a Redis hiccup)."""
    valkey = next(pid for pid in descendants(gw.proc.popen.pid)
                  if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                  .split(b" ")[0].endswith(b"valkey-server"))
    mark = len(gw.proc.output())
    os.kill(valkey, signal.SIGSTOP)
    try:
        ok, failures = conversations(gw)
    finally:
        os.kill(valkey, signal.SIGCONT)
    print(f"\nresponses, Redis stopped: {ok}/{CONVERSATIONS} succeeded")
    assert "redis unavailable" in gw.proc.output()[mark:].lower()  # it was away indeed
    assert (ok, failures) == (CONVERSATIONS, [])


def test_without_pinning_follow_ups_fail_when_they_land_elsewhere(unpinned: Gateway) -> None:
    ok, failures = conversations(unpinned)
    print(f"\nresponses, pin_responses = false: {ok}/{CONVERSATIONS} succeeded; "
          f"{len(failures)} failed, e.g. {failures[:1]}")
    # Each failure is vLLM's own 404 for an id the other instance never stored.
    assert all(f.startswith("404") and "not found" in f for f in failures)
    assert ok + len(failures) == CONVERSATIONS


def test_streamed_response_retrieved_by_id_from_the_instance_that_stored_it(
        gw: Gateway) -> None:
    client = sdk(gw)
    with client.responses.stream(model="tiny-llama", input="count", max_output_tokens=6,
                                 store=True) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    where = None
    for _ in range(4):  # alone, a retrieval would land on either instance
        raw = client.responses.with_raw_response.retrieve(final.id)
        assert raw.parse().id == final.id and raw.parse().status in DONE
        where = where or raw.headers["x-gateway-backend"]
        assert raw.headers["x-gateway-backend"] == where
    # vLLM's own answer to cancelling a finished response, from that same instance.
    cancel = httpx.post(f"{gw.url}/v1/responses/{final.id}/cancel", timeout=30)
    assert cancel.status_code == 400 and cancel.headers["x-gateway-backend"] == where


def test_models_by_id_keeps_vllms_fields(gw: Gateway) -> None:
    card = sdk(gw).models.retrieve("tiny-llama")
    assert card.id == "tiny-llama" and card.owned_by == "vllm"
    extra = card.model_extra or {}
    assert extra["max_model_len"] == 1024 and extra["root"].endswith("tiny-llama")
    with pytest.raises(openai.NotFoundError):
        sdk(gw).models.retrieve("no-such-model")


def test_anthropic_messages_through_the_gateway(gw: Gateway) -> None:
    body = {"model": "tiny-llama", "max_tokens": 5,
            "messages": [{"role": "user", "content": "hello"}]}
    reply = httpx.post(gw.url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["usage"]["output_tokens"] >= 1
    assert reply.headers["x-gateway-backend"] in ("v1", "v2")
    streamed = httpx.post(gw.url + "/v1/messages", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200
    assert "event: message_start" in streamed.text and "event: message_stop" in streamed.text


def logged(gw: Gateway, ids: list[str]) -> list[dict[str, Any]] | None:
    """The access-log lines of these requests, in this order; None until all are written
    (a request is counted and logged once it has ended, after its last byte went out)."""
    lines = {line["id"]: line for line in (json.loads(text) for text in
                                            gw.proc.output().splitlines()
                                            if '"gateway.access"' in text)}
    return [lines[i] for i in ids] if all(i in lines for i in ids) else None


def test_tokens_are_counted_from_vllms_own_usage(gw: Gateway) -> None:
    """The default config reads vLLM's usage from the tail of each reply: each request's
    access line carries vLLM's own counts, and the token metric grows by them."""
    def completion() -> float:
        return metric(gw.url, "gateway_tokens_total", key="anonymous", model="tiny-llama",
                      kind="completion")

    ids = [f"tokens-{uuid.uuid4().hex}" for _ in range(2)]
    before = completion()
    reply = sdk(gw).chat.completions.create(model="tiny-llama", max_tokens=5,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_headers={"x-request-id": ids[0]})
    stream = list(sdk(gw).chat.completions.create(
        model="tiny-llama", max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}], extra_headers={"x-request-id": ids[1]}))
    usages = [reply.usage, stream[-1].usage]
    assert all(u is not None for u in usages)
    lines = wait_for(lambda: logged(gw, ids), 10, "both requests logged")
    assert [line["tokens"] for line in lines] == [
        [u.prompt_tokens, u.completion_tokens] for u in usages if u is not None]
    # Counted before each line was written; another test's request may have ended meanwhile.
    assert completion() - before >= sum(u.completion_tokens for u in usages if u is not None)


@pytest.fixture(scope="module")
def injecting(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    backends = "".join(backend_toml(b, s["url"]) for b, s in sorted(status(gw).items()))
    gateway = Gateway(tmp_path_factory.mktemp("injecting"),
                      '[accounting]\nstream_usage = "inject"\n[health]\ninterval = 0.5\n'
                      + backends, name="injecting")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 30, "injecting ready")
    yield gateway
    gateway.stop()


def test_an_injected_usage_chunk_is_taken_out_of_real_vllms_stream(injecting: Gateway) -> None:
    chunks = list(sdk(injecting).chat.completions.create(
        model="tiny-llama", max_tokens=6, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "count"}]))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    # Counted when the request has ended, which may come just after the client's last byte.
    wait_for(lambda: metric(injecting.url, "gateway_tokens_total", model="tiny-llama",
                            kind="completion") == 6, 10, "the stream's tokens counted")
