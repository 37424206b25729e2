"""The core types of the request path, named once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from backends.backend import Backend


@dataclass(slots=True)
class RequestContext:
    """Everything a policy may look at, parsed once from the request."""

    request_id: str
    path: str
    model: str
    stream: bool
    session_key: str | None
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(repr=False)
    payload: dict[str, object] = field(default_factory=dict, repr=False)
    group: str | None = None  # the canary arm (backend group), when a rollout is on
    shadow: asyncio.Task[None] | None = field(default=None, repr=False)


class Policy(Protocol):
    """Chooses one backend among already-filtered candidates. No I/O."""

    def choose(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend | None: ...
