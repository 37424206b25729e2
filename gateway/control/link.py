"""A serving worker's side of the control socket: adopt the snapshot, forward verbs.

The worker reports its in-flight counts and its view of each backend every ``interval``
and adopts each new version of the control process's snapshot whole
(``gateway.control.snapshot``): it does not probe or scrape the backends itself. The admin
verbs that change a backend's life, and reload, go to the control process, which owns them
for every worker. When the control process does not answer, the worker serves on the last
snapshot and says so (``state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import orjson
from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response

from backends.backend import Backend
from gateway.admin.backends import Admin
from gateway.control.snapshot import Adopter
from gateway.errors import GatewayError
from gateway.metrics import LifecycleCounts
from gateway.routing.pool import BackendPool

log = logging.getLogger("gateway.control")

BASE = "http://control"  # any host: the connector goes to the socket


class ControlUnavailable(GatewayError):
    status = 503
    code = "control_unavailable"


class Forwarded(GatewayError):
    """The control process's own error answer, passed on as it came."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__("answered by the control process")
        self.status = status
        self._body = body

    def body(self) -> bytes:
        return self._body


class ControlLink:
    def __init__(self, path: str, pool: BackendPool, interval: float = 0.2,
                 replaced: Gauge | None = None,
                 pins: Callable[[], dict[str, int]] = dict,
                 recent: Callable[[], Iterable[dict[str, Any]]] = tuple,
                 wanted: Callable[[], list[str]] = list) -> None:
        self._path = path
        self._pool = pool
        self._interval = interval
        self._replaced = replaced  # the workers the control process replaced, by why
        self._pins = pins  # the sessions this worker pinned, per backend
        self._session: aiohttp.ClientSession | None = None
        self.adopt = Adopter(pool)
        # Summed over the workers by the control process, as of the last sync.
        self.replica: dict[str, Any] = {"in_flight": {}, "pins": {}}
        self.lifecycle: LifecycleCounts = {}  # the control plane's (gateway.metrics)
        self._recent = recent  # this worker's recent degraded replies, newest first
        self._wanted = wanted  # models its requests wait for (their instances stopped)
        self._told = 0.0  # the newest of them the control process was told of
        self.problems = self.adopt.problems
        self._failing = False
        # The control process's reloads: the last one taken, and what takes the next.
        self.config_version = 0
        self.on_config: Callable[[str, int], object] | None = None
        self._lost_at: float | None = None  # wall clock: the control has not answered since

    def discovered(self) -> dict[str, list[str]]:
        """Each discover entry's addresses, as the control process last found them."""
        return self.adopt.discovered

    async def discovery_changed(self, within: float) -> None:
        """Until the control process's discovered addresses change, or ``within`` s pass."""
        changed = self.adopt.rediscover
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await changed.wait()
        changed.clear()

    def state(self) -> str:
        """The control process as this worker sees it, for ``/readyz``."""
        if self._lost_at is None:
            return "reachable"
        return (f"unreachable for {time.time() - self._lost_at:.0f} s: serving on the "
                "backends' last known states")

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # opened on first use, inside the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self._path),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
        return self._session

    async def sync_once(self) -> None:
        backends = {b.name: [b.in_flight, b.state.value, b.uses] for b in self._pool.backends}
        new = [e for e in self._recent() if float(e["at"]) > self._told]
        body = orjson.dumps({"pid": os.getpid(), "backends": backends, "pins": self._pins(),
                             "config": self.config_version, "degraded": new,
                             "wanted": self._wanted()})
        async with self._http().post(BASE + "/control/sync", data=body,
                                     timeout=aiohttp.ClientTimeout(total=2.0)) as reply:
            reply.raise_for_status()
            answer = orjson.loads(await reply.read())
        self.adopt(answer["snapshot"])
        if new:
            self._told = max(float(e["at"]) for e in new)
        config = answer.get("config")
        if config is not None and self.on_config is not None:
            self.config_version = int(config["version"])  # asked once, whatever comes of it
            self.on_config(str(config["text"]), self.config_version)
        self.replica = answer.get("replica", self.replica)
        self.lifecycle = answer.get("lifecycle", self.lifecycle)
        if self._replaced is not None:
            for why, count in answer.get("replaced", {}).items():
                self._replaced.labels(why).set(count)

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
                if self._failing:
                    log.warning("control process reachable again")
                self._failing, self._lost_at = False, None
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError) as exc:
                if not self._failing:
                    log.error("control process unreachable: %r; serving on the backends' "
                              "last known states", exc)
                    self._lost_at = time.time()
                self._failing = True
            await asyncio.sleep(self._interval)

    async def forward(self, request: Request) -> Response:
        """An admin verb, answered by the control process."""
        status, body = await self._call(request.method, request.url.path, await request.body())
        return Response(body, status, media_type="application/json")

    async def reload(self, who: str) -> dict[str, Any]:
        """Reload in the control process, which then tells every worker."""
        status, body = await self._call("POST", "/admin/reload", orjson.dumps({"who": who}))
        if status != 200:
            raise Forwarded(status, body)
        reply: dict[str, Any] = orjson.loads(body)
        return reply

    async def _call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            async with self._http().request(method, BASE + path, data=body) as reply:
                return reply.status, await reply.read()
        except (aiohttp.ClientError, OSError) as exc:
            log.error("control process unreachable for %s %s: %r", method, path, exc)
            raise ControlUnavailable("the control process is unreachable") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class ForwardedAdmin(Admin):
    """A serving worker's admin API: status is its own view; what changes a backend's life
    is done by the control process, for every worker at once."""

    def __init__(self, link: ControlLink, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._link = link

    def problem(self, name: str) -> str | None:
        return self._link.problems.get(name)

    def in_flight(self, backend: Backend) -> int:
        """Every worker's requests, as the control process last summed them."""
        return int(self._link.replica["in_flight"].get(backend.name, backend.in_flight))

    async def drain(self, request: Request) -> Response:
        return await self._link.forward(request)

    restart = stop = start = rolling_restart = sleep = wake = drain
