"""Prefix-aware: requests whose prompts start alike go to the same backend, where vLLM's
prefix cache already holds those blocks; consistent hashing with bounded load keeps one
popular prefix from overloading its backend."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from backends.backend import Backend
from gateway.routing.hashing import ranked
from gateway.types import Request


def prompt_head(payload: dict[str, object], chars: int) -> bytes:
    """The leading ``chars`` characters of what the model will read first."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
                size += len(content)
                if size >= chars:
                    break
        return "\n".join(parts)[:chars].encode()
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return str(prompt or "")[:chars].encode()


def bounded(key: bytes, candidates: Sequence[Backend], factor: float,
            others: Mapping[str, int] | None = None) -> Backend:
    """``key``'s first backend in rendezvous order that takes no more than ``factor`` x the
    average in flight (counting this request): consistent hashing with bounded load.
    ``others``: the other serving processes' requests in flight, beside this one's own."""
    others = others or {}
    load = {b.name: b.in_flight + others.get(b.name, 0) for b in candidates}
    cap = math.ceil((sum(load.values()) + 1) * factor / len(candidates))
    order = ranked(key, candidates)
    return next((b for b in order if load[b.name] < cap), order[0])


class PrefixAware:
    def __init__(self, chars: int, load_factor: float) -> None:
        self._chars = chars
        self._factor = load_factor

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend:
        return bounded(prompt_head(request.payload, self._chars), candidates, self._factor)

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        return [self.choose(candidates, request)]
