"""The admin API under /admin: backend status, drain, restart, rolling restart.

Protected by ``[gateway] admin_key`` (Bearer); with no admin key, loopback clients only.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backends.backend import Backend, BackendState
from backends.supervisor import Settle, Supervisor, drain
from gateway.admin.body import read_body
from gateway.errors import AdminUnauthorized, BackendNotFound, GatewayError, NotSpawned
from gateway.http.asgi import request_id
from gateway.http.auth import Refusals, bearer
from gateway.resilience.breaker import Breakers
from gateway.routing.pool import BackendPool

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
Handler = Callable[[Request], Awaitable[Response]]


class Sleeps(Protocol):
    """The control plane's sleep mode (``gateway.control.demand.Demand``)."""

    async def sleep(self, backend: Backend) -> bool: ...

    async def wake(self, backend: Backend) -> bool: ...


class Admin:
    def __init__(self, pool: BackendPool, supervisors: dict[str, Supervisor], breakers: Breakers,
                 admin_key: str | None, drain_timeout: float, settle: Settle | None = None,
                 trusted: bool = False, refusals: Refusals | None = None,
                 demand: Sleeps | None = None) -> None:
        """``trusted``: every caller may act (the control socket, private to its process's
        user); ``settle``: see ``backends.supervisor.drain``."""
        self._pool = pool
        self._breakers = breakers
        self._supervisors = supervisors
        self._key = admin_key.encode() if admin_key else None
        self._drain_timeout = drain_timeout
        self._settle = settle
        self._trusted = trusted
        self._refusals = refusals
        self._demand = demand  # the control plane's: sleep and wake

    def routes(self) -> list[Route]:
        return [
            Route("/admin/status", self.guard(self.status), methods=["GET"]),
            Route("/admin/backends/{name}/drain", self.guard(self.drain), methods=["POST"]),
            Route("/admin/backends/{name}/restart", self.guard(self.restart), methods=["POST"]),
            Route("/admin/backends/{name}/stop", self.guard(self.stop), methods=["POST"]),
            Route("/admin/backends/{name}/start", self.guard(self.start), methods=["POST"]),
            Route("/admin/rolling-restart", self.guard(self.rolling_restart), methods=["POST"]),
            Route("/admin/backends/{name}/sleep", self.guard(self.sleep), methods=["POST"]),
            Route("/admin/backends/{name}/wake", self.guard(self.wake), methods=["POST"]),
        ]

    def guard(self, handler: Handler) -> Handler:
        """Check the admin key, and answer an AdminError the handler raises in the OpenAI
        error format."""

        async def guarded(request: Request) -> Response:
            try:
                if not self.allowed(request):
                    self._refused(request)
                    raise AdminUnauthorized(
                        "admin key required (Authorization: Bearer <admin key>)")
                return await handler(request)
            except GatewayError as exc:
                return Response(exc.body(), exc.status, media_type="application/json")

        return guarded

    def allowed(self, request: Request) -> bool:
        if self._trusted:
            return True
        if self._key is None:
            return request.client is not None and request.client.host in LOOPBACK
        token = bearer(request.scope["headers"])
        return bool(token) and hmac.compare_digest(token, self._key)

    def _refused(self, request: Request) -> None:
        if self._refusals is None:
            return
        reason = ("not_loopback" if self._key is None else
                  "invalid" if bearer(request.scope["headers"]) else "missing")
        self._refusals("admin", reason, request.client.host if request.client else "",
                       request.url.path, request_id(request.scope))

    def _backend(self, request: Request) -> Backend:
        name = request.path_params["name"]
        backend = next((b for b in self._pool.backends if b.name == name), None)
        if backend is None:
            raise BackendNotFound("no such backend")
        return backend

    def _supervisor(self, backend: Backend) -> Supervisor:
        supervisor = self._supervisors.get(backend.name)
        if supervisor is None:
            raise NotSpawned(f"backend {backend.name} is not spawned by the gateway")
        return supervisor

    async def status(self, request: Request) -> Response:
        now = time.monotonic()
        return JSONResponse({"backends": [
            {
                "name": b.name, "group": b.spec.group, "url": b.spec.shown_url,
                "spawned": b.managed,
                "state": b.state.value, "sleep_level": b.sleep_level, "pid": b.pid,
                "uptime_s": round(now - b.started_at, 1) if b.started_at is not None else None,
                "restarts": b.restarts, "in_flight": self.in_flight(b),
                "last_probe": b.last_probe,
                "flaps": b.flaps, "models": sorted(b.models),
                "breaker": self._breakers.status(b.name),
                "problem": self.problem(b.name),
            }
            for b in self._pool.backends
        ]})

    def in_flight(self, backend: Backend) -> int:
        """Its requests in flight, as this replica counts them."""
        return backend.in_flight

    def problem(self, name: str) -> str | None:
        """Why a spawned backend was not started, if it was not."""
        supervisor = self._supervisors.get(name)
        return supervisor.problem if supervisor is not None else None

    async def drain(self, request: Request) -> Response:
        backend = self._backend(request)
        body = await read_body(request, "then", "timeout")
        then = body.get("then", "none")
        timeout = float(body.get("timeout", self._drain_timeout))
        supervisor = self._supervisor(backend) if then != "none" else None
        drained = await drain(backend, timeout, settle=self._settle)
        if supervisor is not None and then == "restart":
            await supervisor.restart()
        elif supervisor is not None and then == "stop":
            await supervisor.stop()
        return JSONResponse({"backend": backend.name, "drained": drained,
                             "state": backend.state.value})

    async def restart(self, request: Request) -> Response:
        return await self._act(request, lambda s: s.restart())

    async def stop(self, request: Request) -> Response:
        return await self._act(request, lambda s: s.stop())

    async def start(self, request: Request) -> Response:
        backend = self._backend(request)
        await read_body(request)
        if backend.name not in self._supervisors:
            # An external backend: back into rotation once health probes agree.
            backend.start_over()
            return JSONResponse({"backend": backend.name, "state": backend.state.value})

        async def start(s: Supervisor) -> None:
            if s.start():  # its reply says "starting", not the "stopped" it was
                s.backend.start_over()

        return await self._act(request, start)

    async def _act(self, request: Request,
                   action: Callable[[Supervisor], Awaitable[None]]) -> Response:
        backend = self._backend(request)
        await read_body(request)
        await action(self._supervisor(backend))
        return JSONResponse({"backend": backend.name, "state": backend.state.value})

    async def sleep(self, request: Request) -> Response:
        """Drain a backend with sleep mode and put it to sleep (``ok``: it sleeps)."""
        return await self._sleep_or_wake(request, lambda d, b: d.sleep(b))

    async def wake(self, request: Request) -> Response:
        """Wake a sleeping backend and check its answer (``ok``: it is ready)."""
        return await self._sleep_or_wake(request, lambda d, b: d.wake(b))

    async def _sleep_or_wake(self, request: Request,
                             action: Callable[[Sleeps, Backend], Awaitable[bool]]) -> Response:
        backend = self._backend(request)
        await read_body(request)
        spawn = backend.spec.spawn
        if self._demand is None or spawn is None or spawn.sleep_after is None:
            raise NotSpawned("only a spawned backend with sleep_after can sleep")
        ok = await action(self._demand, backend)
        return JSONResponse({"backend": backend.name, "ok": ok, "state": backend.state.value})

    async def rolling_restart(self, request: Request) -> Response:
        """Drain and restart each spawned backend in turn, waiting until it is ready."""
        await read_body(request)
        results = []
        for name, supervisor in self._supervisors.items():
            drained = await supervisor.drain_and_restart()
            ready = await _until_settled(supervisor.backend)
            results.append({"backend": name, "drained": drained, "ready": ready})
            if not ready:
                return JSONResponse({"results": results, "aborted": True}, status_code=500)
        return JSONResponse({"results": results, "aborted": False})


async def _until_settled(backend: Backend, poll: float = 0.1) -> bool:
    assert backend.spec.spawn is not None
    deadline = time.monotonic() + backend.spec.spawn.startup_timeout
    while backend.state is not BackendState.READY and time.monotonic() < deadline:
        if backend.state is BackendState.FAILED:
            return False
        await asyncio.sleep(poll)
    return backend.state is BackendState.READY
