"""The soak's clients: official OpenAI SDK clients (async), each holding conversations
(sessions whose history grows turn by turn) through one gateway replica, half of their
requests streamed. Every request is recorded as the client saw it: its outcome, the backend
that answered (``X-Gateway-Backend``), and for the simulator's replies whether the numbered
tokens (`` tok0 tok1 ...``) came each once, in order, all of them."""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field

import httpx
import openai

from bench.chaos.stack import KEYS

TOKEN = re.compile(r" tok(\d+)")
DEADLINE = 60.0  # seconds: a request without its answer by then is "hung"


@dataclass
class Rec:
    client: int
    replica: int
    session: str
    model: str
    stream: bool
    start: float
    end: float = 0.0
    # ok | http_NNN | connection | cut (the connection broke mid-reply) | stream_error (an
    # error event) | truncated (ended without error, short) | malformed | hung
    outcome: str = ""
    backend: str = ""
    rid: str = ""  # X-Request-ID: the line to look up in the gateway's log
    detail: str = ""
    disordered: bool = False  # a simulator token repeated, skipped or out of order

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass
class Load:
    urls: list[str]
    clients: int
    until: float  # monotonic time at which no new request starts
    seed: int
    vllm: bool
    records: list[Rec] = field(default_factory=list)

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        replica = i % len(self.urls)
        key = list(KEYS.values())[(i // 2) % len(KEYS)]
        model = "tiny-llama" if self.vllm and i % 8 == 7 else "sim-model"
        sdk = openai.AsyncOpenAI(base_url=self.urls[replica] + "/v1", api_key=key,
                                 max_retries=0, timeout=DEADLINE)
        n = 0
        async with sdk:
            while time.monotonic() < self.until:
                n += 1
                history: list[dict[str, str]] = []
                for turn in range(rng.randint(3, 8)):
                    history.append({"role": "user", "content": f"client {i} turn {turn}: go on"})
                    text = await self._turn(sdk, rng, Rec(i, replica, f"c{i}-s{n}", model,
                                                          False, 0.0), history)
                    if text is None:
                        break  # the soak is over, or this turn kept failing
                    history.append({"role": "assistant", "content": text})

    async def _turn(self, sdk: openai.AsyncOpenAI, rng: random.Random, like: Rec,
                    history: list[dict[str, str]]) -> str | None:
        """One turn of a conversation, asked again after a failure (as its user would press
        retry), at most 20 times; None when it never got an answer."""
        for _ in range(20):
            if time.monotonic() >= self.until:
                return None
            rec = Rec(like.client, like.replica, like.session, like.model,
                      rng.random() < 0.5, time.monotonic())
            max_tokens = 8 if rec.model == "tiny-llama" else rng.randint(4, 24)
            text = await _one(sdk, rec, history, max_tokens)
            rec.end = time.monotonic()
            self.records.append(rec)
            await asyncio.sleep(rng.uniform(0.05, 0.6))  # the user reads and types
            if rec.ok:
                return text
        return None


async def _one(sdk: openai.AsyncOpenAI, rec: Rec, messages: list[dict[str, str]],
               max_tokens: int) -> str:
    args = {"model": rec.model, "messages": messages, "max_tokens": max_tokens,
            "extra_headers": {"X-Session-ID": rec.session}}
    text, finish = "", None
    try:
        raw = await sdk.chat.completions.with_raw_response.create(stream=rec.stream, **args)
        rec.backend = raw.headers.get("x-gateway-backend", "")
        rec.rid = raw.headers.get("x-request-id", "")
        if rec.stream:
            parts = []
            async for chunk in raw.parse():
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            text = "".join(parts)
        else:
            reply = raw.parse()
            text, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    except openai.APITimeoutError:
        rec.outcome = "hung"
    except openai.APIStatusError as exc:
        rec.outcome, rec.detail = f"http_{exc.status_code}", str(exc.code or "")
    except openai.APIConnectionError:
        rec.outcome = "connection"
    except openai.APIError as exc:  # an error event inside a 200 stream
        rec.outcome, rec.detail = "stream_error", str(exc.message)[:80]
    except httpx.TransportError as exc:  # the connection broke mid-reply: the client knows
        rec.outcome, rec.detail = "cut", type(exc).__name__
    except ValueError as exc:  # a body that does not parse
        rec.outcome, rec.detail = "malformed", str(exc)[:80]
    if not rec.outcome:
        _judge(rec, text, finish, max_tokens)
    return text


def _judge(rec: Rec, text: str, finish: str | None, max_tokens: int) -> None:
    if rec.model == "sim-model":
        seen = [int(n) for n in TOKEN.findall(text)]
        if seen != list(range(len(seen))):
            rec.disordered = True
        complete = len(seen) == max_tokens
    else:
        complete = True  # real vLLM's text is the model's: its end is the finish reason
    rec.outcome = "ok" if finish is not None and complete else "truncated"
    if rec.outcome != "ok":
        rec.detail = f"finish={finish} text={text[-40:]!r}"
