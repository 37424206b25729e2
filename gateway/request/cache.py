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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.backend import Backend
from gateway.http.headers import upstream_request_headers
from gateway.kv.index import Key, home, keys
from gateway.kv.known import EXACT, INEXACT, Known
from gateway.request.turns import Turns, conversation
from gateway.routing.pool import BackendPool
from gateway.types import Cached, Request
from gateway.upstream import ConnectFailed, Upstream, UpstreamBroken, UpstreamResponse

log = logging.getLogger("gateway.kv")

CHAT = "/v1/chat/completions"
TOKENIZE_WITHIN = 0.5  # seconds; later, the request is routed by the estimate
JSON = (b"content-type", b"application/json")
# Fields of a chat request that vLLM's /tokenize takes as serving does (its chat template).
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
               "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")


def tokenize_body(path: str, payload: Mapping[str, Any]) -> bytes | None:
    """The ``/tokenize`` request for a chat or completion request (None: another route, or
    a prompt the gateway does not read: several, or already token ids)."""
    if path == CHAT and isinstance(payload.get("messages"), list):
        return orjson.dumps({k: payload[k] for k in CHAT_FIELDS if k in payload})
    if path == "/v1/completions" and isinstance(payload.get("prompt"), str):
        return orjson.dumps({"prompt": payload["prompt"],
                             "add_special_tokens": payload.get("add_special_tokens", True)})
    return None


@dataclass
class Prediction:
    """What was predicted of one request's prompt: cached tokens per candidate (``cached``,
    from the index or the estimate as each candidate's standing says) and what the index
    alone said (``events``, checked against what vLLM finds). Told where each attempt went
    (its blocks are guessed there and its prefill counted), when the first byte came
    (the prefill's rate measured) and what vLLM found (what it did not find is gone)."""

    feeds: Known
    cached: Cached
    partial: bool = False  # only the prompt's start is known: a hit is at least this
    events: dict[str, int] = field(default_factory=dict)  # backends whose index is judged
    guessed: dict[str, int] = field(default_factory=dict)  # what the estimate said
    blocks: dict[int, list[Key]] = field(default_factory=dict)  # by block size
    sizes: dict[str, int] = field(default_factory=dict)  # each candidate's block size
    _on: str | None = None  # the backend whose prefill load holds this prompt's tokens
    _ahead = 0  # tokens to prefill there before it, when it was sent
    _tokens = 0  # its own, not cached there
    _at = 0.0
    _in: str | None = None  # the backend whose count of requests holds this one

    def sent(self, backend: str) -> None:
        if self._on is not None:  # the attempt before failed: its guess goes
            self.feeds.index.unguess(self._on, self._of(self._on))
        self._release()
        self._leave()
        self.feeds.prefill.entered(backend)
        self._in = backend
        keys = self._of(backend)
        self.feeds.index.guess(backend, keys)
        self.feeds.estimate.sent(backend, keys)
        self._tokens = max(0, self.cached.tokens - self.cached.get(backend, 0))
        self._ahead = self.feeds.prefill.start(backend, self._tokens)
        self._on, self._at = backend, asyncio.get_running_loop().time()

    def began(self, at: float, stream: bool) -> None:
        if self._on is not None and stream:
            self.feeds.prefill.measured(self._on, self._ahead + self._tokens, at - self._at)
        self._release()

    def ended(self, backend: str | None, found: int | None) -> None:
        self._release()
        self._leave()
        if backend is None or found is None or backend not in self.sizes:
            return
        size = self.sizes[backend]
        keys, blocks = self._of(backend), found // size
        if backend in self.events:
            predicted = self.events[backend]
            self.feeds.checks.record(backend, found >= predicted if self.partial
                                     else found == predicted)
            if found < predicted:
                self.feeds.index.found(backend, keys, blocks)
        if self.partial:  # what was found past the start known is not this estimate's
            blocks, found = min(blocks, len(keys)), min(found, len(keys) * size)
        guessed = self.guessed.get(backend, 0) // size
        self.feeds.estimate.found(backend, keys, guessed, blocks, found)

    def _release(self) -> None:
        if self._on is not None:
            self.feeds.prefill.done(self._on, self._tokens)
            self._on = None

    def _leave(self) -> None:
        if self._in is not None:
            self.feeds.prefill.left(self._in)
            self._in = None

    def _of(self, backend: str) -> list[Key]:
        return self.blocks.get(self.sizes.get(backend, 0), [])


class CacheLookup:
    def __init__(self, feeds: Known, upstream: Upstream, pool: BackendPool) -> None:
        self.feeds = feeds
        self.turns = Turns()
        self._upstream = upstream
        self._pool = pool

    async def __call__(self, request: Request, group: str | None) -> Prediction | None:
        """Cached prompt tokens per candidate; None when they can't be known."""
        body = tokenize_body(request.path, request.payload)
        candidates = self._pool.candidates(request.model, group)
        salt = request.payload.get("cache_salt")
        if body is None or not candidates or not isinstance(salt, str | None):
            self.feeds.lookups["unknown"] += 1
            return None
        # Any candidate renders as the others: spread the work over them.
        asked = candidates[hash(request.request_id) % len(candidates)]
        # A LoRA adapter's blocks chain from its own root: by the name vLLM knows it by (a
        # [[models]] alias resolved), declared or listed with a parent.
        served = self._pool.served(asked, request.model)
        adapter = served in self._pool.adapters.specs
        lora = served if adapter or asked.cards.get(served, {}).get("parent") else None
        names = [b.name for b in candidates]
        talk = conversation(request.model, request.payload) if request.path == CHAT else None
        known = self.turns.recall(talk) if talk is not None else None
        if known is not None:  # a later turn: its history's tokens, no /tokenize
            assert talk is not None
            self.feeds.lookups["remembered"] += 1
            return self.predict(known.tokens, names, lora, salt,
                                total=len(known.tokens) * talk.chars[-1] // max(1, known.chars))
        self.feeds.lookups["asked"] += 1
        tokens = await self._tokens(asked, body, request.request_id)
        if tokens is None:
            self.feeds.lookups["unknown"] += 1
            return None
        if talk is not None:
            self.turns.keep(talk, tokens)
        return self.predict(tokens, names, lora, salt)

    def predict(self, tokens: Sequence[int], names: list[str], lora: str | None = None,
                salt: str | None = None, total: int | None = None) -> Prediction:
        """What each of ``names`` holds of a prompt of ``tokens``, asked of LoRA adapter
        ``lora`` with ``cache_salt`` ``salt``: vLLM keys every block of an adapter's
        prompt by its name, and the first block by the salt too (its events carry both).
        ``total``: the tokens are only the prompt's start, of about ``total`` in all."""
        feeds = self.feeds
        index, estimate = feeds.index, feeds.estimate
        prediction = Prediction(feeds, Cached(total or len(tokens)), partial=total is not None)
        cached = prediction.cached
        for name in names:
            cached.standing[name] = feeds.standing(name)
            prediction.sizes[name] = index.size(name) or estimate.size(name)
        for size in sorted(set(prediction.sizes.values())):  # home: from the smallest
            # vLLM computes a prompt's last token whatever it holds (a hit is at most
            # len - 1 tokens): a prompt of whole blocks finds one block less.
            count = (len(tokens) - (not prediction.partial)) // size
            extras = ([tuple(x for x in (lora, salt if i == 0 else None) if x) or None
                       for i in range(count)] if lora or salt else None)
            blocks = prediction.blocks[size] = keys(tokens[:count * size], size, lora, extras)
            cached.home = cached.home or home(blocks)
            these = [n for n in names if prediction.sizes[n] == size]
            held = index.match(blocks)
            guessed = estimate.match(blocks, these)  # for all: its cap is tuned meanwhile
            for name in these:
                standing = cached.standing[name]
                if standing in (EXACT, INEXACT):  # in step and on time: the index is judged
                    prediction.events[name] = held.get(name, 0) * size
                if guessed.get(name):
                    prediction.guessed[name] = guessed[name] * size
                n = held.get(name, 0) if standing == EXACT else guessed.get(name, 0)
                if n:
                    cached[name] = n * size
        for name in names:
            uncached = cached.tokens - cached.get(name, 0)
            cached.waits[name] = feeds.prefill.wait(name, uncached)
            cached.own[name] = uncached / feeds.prefill.rate(name)
            others = feeds.prefill.others(name)
            if others:
                cached.others[name] = others
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
