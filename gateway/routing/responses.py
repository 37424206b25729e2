"""Where a stored response lives (the Responses API).

vLLM keeps a stored response (``store``, kept when the instance runs with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the instance that made it, so a
follow-up (``previous_response_id``), a retrieval and a cancel must go to that instance:
anywhere else they fail. The gateway names each new response itself, through vLLM's own
``request_id`` field (which becomes the response's ``id``), so it knows the id before the
reply and never reads the reply; once the backend has answered 200 it records
id -> backend in Redis with the pin TTL. A follow-up then goes there or gets a clear error.

Each process also remembers where the last ``REMEMBERED`` responses it made are stored (with
the same TTL), so that a Redis that does not answer for a moment (a timeout, a restart) does
not send the next turns of its conversations astray: the client's connection usually comes
back to the same process, and its follow-up is routed from memory when Redis can't say.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import orjson

from backends.backend import Backend
from gateway.errors import ResponseNotFound, ResponseUnavailable
from gateway.routing.pool import BackendPool
from gateway.state.link import Command, RedisLink, text

log = logging.getLogger("gateway.routing")

RESPONSES = "/v1/responses"
REMEMBERED = 4096  # per process: the newest responses it made, id -> (backend, expiry)
_STORED = re.compile(r"/v1/responses/([^/]{1,256})(/cancel)?")


def stored_route(path: str) -> tuple[str, str] | None:
    """``(response id, method)`` for ``GET /v1/responses/{id}`` and
    ``POST /v1/responses/{id}/cancel``; None for any other path."""
    if not path.startswith("/v1/responses/"):
        return None
    match = _STORED.fullmatch(path)
    if match is None:
        return None
    return match[1], "POST" if match[2] else "GET"


class ResponsePins:
    """Response id -> the backend that stored it, in Redis. Off (``None`` link): requests
    are routed as any other and a follow-up may land where its state is not."""

    def __init__(self, link: RedisLink | None, ttl: float, pool: BackendPool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._link = link
        self._pool = pool
        self._prefix = (link.prefix if link is not None else "") + "resp:"
        self._ttl = ttl
        self._ttl_ms = int(ttl * 1000)
        self._clock = clock
        self._made: OrderedDict[str, tuple[str, float]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._link is not None

    def name(self, payload: dict[str, object],
             body: bytes) -> tuple[bytes, str | None, str | None]:
        """A ``POST /v1/responses``: the body to send, the id of the response it will store
        (the client's ``request_id``, else one the gateway adds), and the id it continues."""
        previous = payload.get("previous_response_id")
        follows = previous if isinstance(previous, str) and previous else None
        if self._link is None:
            return body, None, None
        if payload.get("store") is False:
            return body, None, follows
        given = payload.get("request_id")
        if isinstance(given, str) and given:
            return body, given, follows
        payload["request_id"] = created = f"resp_{uuid.uuid4().hex}"
        return orjson.dumps(payload), created, follows

    def command(self, response_id: str) -> Command:
        """The lookup of where ``response_id`` is stored, for the request's round trip."""
        return ("GET", self._prefix + response_id)

    def where(self, response_id: str, required: bool, answered: bool,
              result: object) -> Backend | None:
        """The backend that stored ``response_id``, from the lookup's answer, else from
        this process's memory of the responses it made. Without either: None for a
        follow-up (``required=False``: it is routed as any request, and vLLM says if it
        doesn't know the id), 404 for a retrieval or cancel (503 when Redis did not
        answer). Its backend gone: 503 naming the id."""
        named = text(result) if answered and not isinstance(result, Exception) else None
        named = named or self._remembered(response_id)
        shown = response_id[:256]
        if named is None:
            if answered:
                if required:
                    raise ResponseNotFound(f"Response with id '{shown}' not found.")
                return None
            if not required:
                log.warning("response %s: Redis can't say where it is stored; routed as any "
                            "request", shown)
                return None
            raise ResponseUnavailable(f"where response '{shown}' is stored can't be looked up "
                                      "now; retry shortly")
        backend = next((b for b in self._pool.backends if b.name == named), None)
        if backend is None or not backend.routable or not self._pool.allows(backend):
            raise ResponseUnavailable(
                f"response '{shown}' is stored on a backend that is unavailable now; it can't "
                "be continued on another one (retry later, or start without it)",
                "previous_response_id" if not required else None)
        return backend

    def _remembered(self, response_id: str) -> str | None:
        kept = self._made.get(response_id)
        if kept is None or kept[1] <= self._clock():
            return None
        return kept[0]

    async def record(self, response_id: str, backend: Backend) -> None:
        """Remember where ``response_id`` is stored (after its backend answered 200), here
        and in Redis."""
        if self._link is not None:
            self._made[response_id] = (backend.name, self._clock() + self._ttl)
            self._made.move_to_end(response_id)
            if len(self._made) > REMEMBERED:
                self._made.popitem(last=False)
            await self._link.execute(("SET", self._prefix + response_id, backend.name,
                                      "PX", self._ttl_ms))

