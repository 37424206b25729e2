"""What each candidate backend already holds of a request's prompt in its KV cache, from the
index fed by vLLM's events (``gateway.kv``): the prompt's token ids as vLLM will see them
(vLLM's own ``/tokenize`` on a candidate: the same renderer and chat template as serving),
their full blocks' keys, and the longest cached prefix per backend, in tokens.

Asked with the request's Redis round trip (concurrently), before it is routed. Whatever
fails (no candidate to ask, a route that is neither chat nor completions, a tokenizer that
errs or is slow) leaves the request to the policy's estimate, counted; never an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.backend import Backend
from gateway.http.headers import upstream_request_headers
from gateway.kv.index import Index, Key, keys
from gateway.routing.pool import BackendPool
from gateway.types import Request
from gateway.upstream import ConnectFailed, Upstream, UpstreamBroken, UpstreamResponse

log = logging.getLogger("gateway.kv")

TOKENIZE_WITHIN = 0.5  # seconds; later, the request is routed by the estimate
JSON = (b"content-type", b"application/json")
# Fields of a chat request that vLLM's /tokenize takes as serving does (its chat template).
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
               "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")


def tokenize_body(path: str, payload: Mapping[str, Any]) -> bytes | None:
    """The ``/tokenize`` request for a chat or completion request (None: another route, or
    a prompt the gateway does not read: several, or already token ids)."""
    if path == "/v1/chat/completions" and isinstance(payload.get("messages"), list):
        return orjson.dumps({k: payload[k] for k in CHAT_FIELDS if k in payload})
    if path == "/v1/completions" and isinstance(payload.get("prompt"), str):
        return orjson.dumps({"prompt": payload["prompt"],
                             "add_special_tokens": payload.get("add_special_tokens", True)})
    return None


@dataclass
class Prediction:
    """What the index said of one request's prompt: cached tokens per candidate (absent:
    none). Told where the request went (its blocks are guessed there until the events say)
    and what vLLM then found there (what it did not find is not there)."""

    index: Index
    cached: dict[str, int] = field(default_factory=dict)
    blocks: dict[int, list[Key]] = field(default_factory=dict)  # by block size

    def sent(self, backend: str) -> None:
        self.index.guess(backend, self._of(backend))

    def found(self, backend: str, tokens: int) -> None:
        size = self.index.size(backend)
        if size and tokens < self.cached.get(backend, 0):
            self.index.found(backend, self._of(backend), tokens // size)

    def _of(self, backend: str) -> list[Key]:
        return self.blocks.get(self.index.size(backend), [])


class CacheLookup:
    def __init__(self, index: Index, upstream: Upstream, pool: BackendPool) -> None:
        self.index = index
        self._upstream = upstream
        self._pool = pool
        self.unknown = 0  # requests routed by the estimate: no tokens to match
        self.asked = 0

    async def __call__(self, request: Request, group: str | None) -> Prediction | None:
        """Cached prompt tokens per candidate; None when they can't be known."""
        body = tokenize_body(request.path, request.payload)
        candidates = self._pool.candidates(request.model, group)
        if body is None or not candidates or "cache_salt" in request.payload:
            self.unknown += 1
            return None
        self.asked += 1
        # Any candidate renders as the others: spread the work over them.
        asked = candidates[hash(request.request_id) % len(candidates)]
        tokens = await self._tokens(asked, body, request.request_id)
        if tokens is None:
            self.unknown += 1
            return None
        prediction = Prediction(self.index)
        for size in {self.index.size(b.name) for b in candidates} - {0}:
            # vLLM computes a prompt's last token whatever it holds (a hit is at most
            # len - 1 tokens): a prompt of whole blocks finds one block less.
            prediction.blocks[size] = keys(tokens[:-1], size)
            found = self.index.match(prediction.blocks[size])
            prediction.cached.update({name: n * size for name, n in found.items()
                                      if self.index.size(name) == size})
        return prediction

    async def _tokens(self, backend: Backend, body: bytes, rid: str) -> list[int] | None:
        headers = upstream_request_headers([JSON], backend, rid, b"")
        reply: UpstreamResponse | None = None
        whole = False
        try:
            async with asyncio.timeout(TOKENIZE_WITHIN):
                reply = await self._upstream.request("POST", backend.url + "/tokenize",
                                                     headers, body)
                chunks = []
                while chunk := await reply.read():
                    chunks.append(chunk)
                whole = True
        except (TimeoutError, ConnectFailed, UpstreamBroken, OSError) as exc:
            log.info("request %s: no tokens from %s: %s", rid, backend.name,
                     type(exc).__name__)
            return None
        finally:
            if reply is not None:  # a reply cut short: its connection is not reused
                await reply.aclose(reuse=whole)
        if reply.status != 200:
            return None
        try:
            tokens = orjson.loads(b"".join(chunks)).get("tokens")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens
