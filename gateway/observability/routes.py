"""The operators' read-only routes: liveness, readiness, Prometheus metrics and the status
page with its data (the data behind the admin key)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.metrics import Metrics
from gateway.observability.status import Status
from gateway.routing.pool import BackendPool

Handler = Callable[[Request], Awaitable[Response]]
PAGE = Path(__file__).parent / "dashboard.html"


class OpsRoutes:
    def __init__(self, pool: BackendPool, status: Status, metrics: Metrics,
                 guard: Callable[[Handler], Handler], allowed: Callable[[Request], bool],
                 public: bool = True) -> None:
        """``public``: /metrics, /dashboard and /readyz's detail open to anyone; else behind
        ``guard`` (the admin key), and /readyz answers its status code alone to others."""
        self._pool = pool
        self._status = status
        self._metrics = metrics
        self._guard = guard
        self._allowed = allowed
        self._public = public
        self._page = PAGE.read_text(encoding="utf-8")

    def routes(self) -> list[Route]:
        private = self._guard
        shown = (lambda handler: handler) if self._public else private
        return [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", shown(self.metrics), methods=["GET"]),
            Route("/dashboard", shown(self.dashboard), methods=["GET"]),
            Route("/dashboard/data", private(self.dashboard_data), methods=["GET"]),
        ]

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "pid": os.getpid()})

    async def readyz(self, request: Request) -> Response:
        ready = self._pool.ready
        body: dict[str, object] = {"ready": ready}
        if self._public or self._allowed(request):
            body["backends"] = {b.name: b.state.value for b in self._pool.backends}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        self._status.refresh()
        return Response(self._metrics.render(), media_type="text/plain; version=0.0.4")

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(self._page, headers={"cache-control": "no-store"})

    async def dashboard_data(self, request: Request) -> Response:
        return JSONResponse(self._status.data())

    async def refresh(self, every: float = 1.0) -> None:
        """Keep the gauges fresh (in multiprocess mode, other workers' come from here)."""
        while True:
            self._status.refresh()
            await asyncio.sleep(every)
