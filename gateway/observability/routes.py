"""The operators' read-only routes: liveness, readiness, Prometheus metrics and the status
page with its data (the data behind the admin key)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.metrics import Metrics
from gateway.observability.status import Status
from gateway.routing.pool import BackendPool

Handler = Callable[[Request], Awaitable[Response]]
PAGE = Path(__file__).parent / "dashboard.html"


def started(pid: int) -> float:
    """When process ``pid`` started, wall clock (Linux's /proc; elsewhere, now). A worker
    asks of its parent: the gateway is as old as its control process."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in
                    Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass(frozen=True, slots=True)
class About:
    """The gateway itself, as the status page's header shows it."""

    version: str = ""
    started: float = 0.0  # wall clock
    grafana_url: str | None = None

    def data(self, now: float) -> dict[str, object]:
        grafana = self.grafana_url
        if grafana is not None:  # a user:password@ in it is not shown, nor linked
            parts = urlsplit(grafana)
            grafana = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        return {"version": self.version, "pid": os.getpid(),
                "uptime_s": round(max(0.0, now - self.started), 1), "grafana_url": grafana}


class OpsRoutes:
    def __init__(self, pool: BackendPool, status: Status, metrics: Metrics,
                 guard: Callable[[Handler], Handler], allowed: Callable[[Request], bool],
                 public: bool = True, about: About | None = None,
                 control: Callable[[], str] | None = None) -> None:
        """``public``: /metrics, /dashboard and /readyz's detail open to anyone; else behind
        ``guard`` (the admin key), and /readyz answers its status code alone to others.
        ``control``: a serving worker's view of its control process, in /readyz's detail."""
        self._control = control
        self._pool = pool
        self._status = status
        self._metrics = metrics
        self._guard = guard
        self._allowed = allowed
        self._public = public
        self._about = about or About(started=time.time())
        self._page = PAGE.read_text(encoding="utf-8")
        # The batches not yet ended (set by gateway.build where the batch API runs).
        self.batches: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None

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
            if self._control is not None:
                body["control"] = self._control()
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        self._status.refresh()
        return Response(self._metrics.render(), media_type="text/plain; version=0.0.4")

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(self._page, headers={"cache-control": "no-store"})

    async def dashboard_data(self, request: Request) -> Response:
        batches = await self.batches() if self.batches is not None else []
        return JSONResponse({"gateway": self._about.data(time.time()), **self._status.data(),
                             "batches": batches})

    async def refresh(self, every: float = 1.0) -> None:
        """Keep the gauges fresh (in multiprocess mode, other workers' come from here), and
        sample the trends when their step comes."""
        while True:
            self._status.refresh()
            self._status.trends.tick(time.monotonic(), time.time())
            await asyncio.sleep(every)
