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
    # What happened, for the request log and metrics (filled in along the way).
    started: float = 0.0  # loop time the body was in
    status: int = 0  # what the client got
    served_by: Backend | None = field(default=None, repr=False)
    first_byte: float | None = None
    last_byte: float | None = None
    chunks: int = 0
    note: str = ""  # degraded:cache, stream:dropped, client gone...


class Policy(Protocol):
    """Chooses one backend among already-filtered candidates. No I/O."""

    def choose(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend | None: ...

    def rewind(self) -> None:
        """Take back the last ``choose``: its choice was not used (the session turned out
        to be pinned already), so the policy's rotation must not count it."""
