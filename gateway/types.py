"""The core types of the request path, named once.

A client request is parsed once into a frozen ``Request``: what policies, the router and
the reply cache look at. What happens to it (its canary arm, the backend that served it,
the status and timings for the log and metrics) is written to its ``Record``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from backends.backend import Backend

BATCH_BAND = -1  # the queue band of batch lines: below every key's priority (0 to 9)


@dataclass(frozen=True, slots=True)
class Request:
    """What the client asked, parsed once from the request."""

    request_id: str
    path: str
    model: str
    stream: bool
    session_key: str | None
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(repr=False)
    payload: dict[str, object] = field(default_factory=dict, repr=False)
    started: float = 0.0  # loop time the body was in
    client: str = ""  # the address the gateway believes (gateway.http.forwarded)
    forwarded_for: bytes = b""  # the X-Forwarded-For sent upstream
    method: str = "POST"
    creates: str | None = None  # the id of the stored response it makes (Responses API)
    follows: str | None = None  # the stored response it continues, retrieves or cancels
    strip_usage: bool = False  # the gateway asked for a usage chunk the client did not
    # Prompt tokens each candidate holds in its KV cache (issue 38): None when unknown.
    cached: Cached | None = None


class Cached(dict[str, int]):
    """Prompt tokens each candidate holds in its KV cache, as predicted (absent: none),
    with what the ``kv`` policy weighs beside: the prompt's length, each candidate's
    expected prefill wait (``gateway.kv.prefill``) and the request's own share of it
    (``own``: its uncached tokens alone), how each is known (its standing) and
    the key of the prompt's head that places it where nothing holds it (``home``); the
    policy writes the rule that decided, for the access log and the debug header."""

    __slots__ = ("home", "others", "own", "rule", "standing", "tokens", "waits")

    def __init__(self, tokens: int = 0, home: bytes | None = None) -> None:
        super().__init__()
        self.tokens = tokens
        self.home = home
        self.waits: dict[str, float] = {}
        self.own: dict[str, float] = {}
        self.others: dict[str, int] = {}  # the other serving processes' requests in flight
        self.standing: dict[str, str] = {}
        self.rule = ""


class StreamCause(enum.StrEnum):
    """Why a relay ended before its reply did (a metric label and a log note)."""

    INBAND = "inband"  # the backend reported an error inside a 200 stream
    DROPPED = "dropped"  # the connection broke
    STALLED = "stalled"  # no byte within the idle timeout
    RESUMED = "resumed"  # broke, and its continuation elsewhere did not finish it either


@dataclass(slots=True)
class Facts:
    """What Redis said of one request's session, read once before it is routed."""

    answered: bool = False  # False: Redis could not say (hash the session meanwhile)
    pin: str | None = None  # the backend it is pinned to (None: none)
    new: bool = False  # ``pin`` is the one proposed for it: its first request
    unread: str = ""  # "sole": not read, the only backend that could take it (pinned there)
    arm: str | None = None  # the canary arm it was given (None: none yet)


@dataclass(slots=True)
class Record:
    """What happened to one request, filled in along the way."""

    request: Request
    group: str | None = None  # the canary arm (backend group), when a rollout is on
    shadow: asyncio.Task[None] | None = field(default=None, repr=False)
    status: int = 0  # what the client got
    served_by: Backend | None = field(default=None, repr=False)
    first_byte: float | None = None
    last_byte: float | None = None
    chunks: int = 0
    note: str = ""  # degraded cache, stream dropped, client gone...
    tenant: str = "anonymous"  # the calling key's name
    priority: int = 0  # its key's band in the gateway's queue (BATCH_BAND: a batch line)
    placed: bool = False  # it took a place on a backend (freed when it ends)
    attempts: int = 0  # backends asked (the access log's "attempts")
    outside_arm: bool = False  # its canary arm had no backend left: stable serves it
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens, as vLLM counted
    cached: int | None = None  # prompt tokens vLLM found cached (predicted requests only)
    prediction: CachePrediction | None = field(default=None, repr=False)  # policy "kv"
    admission: object = field(default=None, repr=False)  # what the key's limits lent it
    trace: object = field(default=None, repr=False)  # its spans, when tracing is on
    allowed: frozenset[str] | None = None  # the models its key may use (None: any)
    fallback_of: str | None = None  # the model it asked for, when a fallback answers it
    session: Facts | None = field(default=None, repr=False)  # its session, as Redis said


class CachePrediction(Protocol):
    """What the KV index predicted of a request's prompt (``gateway.request.cache``), told
    where each attempt went, when its first byte came (``loop`` time; only a stream's
    first byte is the prefill's end) and, at the end, what vLLM found cached where it
    was served (None: not said)."""

    def sent(self, backend: str) -> None: ...

    def began(self, at: float, stream: bool) -> None: ...

    def ended(self, backend: str | None, found: int | None) -> None: ...


class Policy(Protocol):
    """Chooses one backend among already-filtered candidates (never empty). No I/O."""

    def choose(self, candidates: Sequence[Backend], request: Request) -> Backend: ...

    def ties(self, candidates: Sequence[Backend], request: Request) -> Sequence[Backend]:
        """The candidates this policy holds equally good for ``request`` (never empty): a
        new session is pinned to the next of them in a turn order kept in Redis, which
        only new sessions advance."""
