"""When the model's own backends give no answer: a reply kept earlier, the model's fallback
(``[[models]] fallback``), the static reply, the error, or 503 (in that order).

The fallback model is asked through the proxy's own attempts (``again``), under the same
total deadline as the request's first attempts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from starlette.types import Send

from backends.backend import Backend
from gateway.errors import GatewayError, ModelNotFound
from gateway.resilience.attempt import stepped_out
from gateway.resilience.degraded import Degraded
from gateway.routing.pool import BackendPool
from gateway.types import Record
from gateway.upstream import UpstreamResponse

Again = Callable[[], Awaitable[None]]


class Rescue:
    def __init__(self, pool: BackendPool, degraded: Degraded) -> None:
        self._pool = pool  # asked for the model map each time: a reload replaces it
        self._degraded = degraded

    async def exhausted(self, record: Record, tried: list[Backend],
                        failure: GatewayError | None, send: Send, again: Again) -> None:
        """No attempt was relayed: an earlier reply, the fallback model, the static reply,
        the error, or 503."""
        model = record.fallback_of or record.request.model
        if not tried and not (self._pool.known_model(model) or self._pool.declared(model)):
            raise ModelNotFound(f"The model `{model}` does not exist.")
        why = (failure.message if failure else
               f"no backend for model {model!r} could be reached" if tried else
               f"no healthy backend serves model {model!r}")
        if await self(record, send, why, again):
            return
        if failure is not None:
            raise failure
        await self._degraded.unavailable(record, send, why)

    async def __call__(self, record: Record, send: Send, why: str, again: Again,
                       reply: UpstreamResponse | None = None,
                       failed: Backend | None = None) -> bool:
        """An answer without the model's backends: a reply kept earlier, its fallback model,
        or the static reply; False when there is none. ``reply`` is the failed backend's
        (closed unused), ``failed`` the backend whose in-flight slot the fallback gives up."""
        request, degraded = record.request, self._degraded
        found = None if record.fallback_of else await degraded.find(request, static=False)
        smaller = None if found else degraded.smaller(
            record, self._pool.names.fallback(request.model))
        if found is None and smaller is None:
            model = record.fallback_of or request.model
            found = await degraded.find(replace(request, model=model), cache=False)
            if found is None:
                return False
        if reply is not None:
            await reply.aclose(reuse=False)
        if smaller is None:
            assert found is not None
            await degraded.send(record, send, found, why)
            return True
        degraded.fallback(record, smaller, why)
        if failed is None:
            await again()
        else:
            with stepped_out(failed):
                await again()
        return True
