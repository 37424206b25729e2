"""The ASGI app: routes, and a lifespan that starts and stops what ``gateway.build`` built.

OpenAI POST routes go straight to the proxy; the rest to Starlette. Nothing imports this
module except the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backends.supervisor import start_in_turn
from backends.vllm_metrics import LoadScraper, Nvml
from gateway.admin.canary import CanaryAdmin
from gateway.admin.reload import apply, background
from gateway.build import Parts, SharedState, build
from gateway.config import CONFIG_ENV, Config, ConfigError, load
from gateway.errors import NoConfigPath, ReloadRefused, StreamAborted, error_body
from gateway.http.asgi import request_id, send_json
from gateway.http.auth import ApiKeyAuth
from gateway.http.framing import Http10Framing
from gateway.observability import logs
from gateway.state.embedded import EmbeddedRedisError, refuse_to_start

log = logging.getLogger("gateway")

DASHBOARD = (Path(__file__).parent / "observability" / "dashboard.html").read_text(
    encoding="utf-8")
PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class GatewayApp:
    """The ASGI app over ``parts``: it routes, and its lifespan runs the parts' tasks."""

    def __init__(self, config: Config, parts: Parts | None = None,
                 config_path: str | None = None) -> None:
        self.config = config
        self.parts = parts = parts or build(config)
        self.pool, self.metrics, self.status = parts.pool, parts.metrics, parts.status
        self.reloadable = parts.reloadable
        self.config_path = config_path or os.environ.get(CONFIG_ENV)
        self.canary_admin = CanaryAdmin(
            parts.canary, parts.admin.guard, self.reload,
            parts.shared.canary_sync.publish if parts.shared is not None else None)
        self._other = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/dashboard", self._dashboard, methods=["GET"]),
                Route("/dashboard/data", parts.admin.guard(self._dashboard_data),
                      methods=["GET"]),
                *parts.admin.routes(),
                *self.canary_admin.routes(),
            ],
            lifespan=self._lifespan,
        )
        keys = [k.get_secret_value() for k in config.gateway.api_keys]
        self._guarded = Http10Framing(ApiKeyAuth(self._dispatch, keys))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXIED:
            if scope["method"] == "POST":
                await self.parts.proxy(scope, receive, send)
            else:
                body = error_body("use POST", "invalid_request_error", "method_not_allowed")
                await send_json(send, 405, body, request_id(scope), [(b"allow", b"POST")])
            return
        await self._other(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if self.parts.shared is not None:
                await stack.enter_async_context(self._shared_state(self.parts.shared))
            await stack.enter_async_context(self._backends())
            yield

    @contextlib.asynccontextmanager
    async def _shared_state(self, shared: SharedState) -> AsyncIterator[None]:
        """Pins, arms, breaker openings, cached replies and the canary, through one link."""
        if shared.embedded is not None:
            try:
                await shared.embedded.start()
            except EmbeddedRedisError as exc:
                refuse_to_start(f"{self.config_path or 'config'}: {exc.key}: {exc}")
            log.info("embedded valkey on %s, data in %s", shared.embedded.url,
                     shared.embedded.data_dir)
        shared.link.open()
        await shared.link.warm()
        tasks = []
        if shared.breaker_sync is not None:
            tasks.append(asyncio.create_task(shared.breaker_sync.run(), name="breaker-sync"))
        if self.parts.canary.enabled:
            await shared.canary_sync.sync_once()  # the shared state before any request
        tasks.append(asyncio.create_task(shared.canary_sync.run(), name="canary-sync"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.parts.replies.aclose()
            await shared.link.aclose()
            if shared.embedded is not None:
                await shared.embedded.stop()

    @contextlib.asynccontextmanager
    async def _backends(self) -> AsyncIterator[None]:
        parts, settings = self.parts, self.config.health
        if self.config.supervisor.sequential_start:
            background(self.reloadable, start_in_turn(list(parts.supervisors.values())))
        else:
            for supervisor in parts.supervisors.values():
                supervisor.start()
        await parts.checker.check_all()
        loops: list[asyncio.Future[None]] = [
            asyncio.create_task(parts.checker.run(), name="health"),
            asyncio.create_task(self._refresh(), name="gauges")]
        if settings.metrics_interval > 0:
            nvml = None
            if any(b.spec.monitored_gpus for b in self.pool.backends):
                nvml = await asyncio.to_thread(Nvml)
            scraper = LoadScraper(self.pool.backends, parts.probe.session,
                                  settings.metrics_interval, settings.timeout, nvml,
                                  self.status.loaded)
            loops.append(asyncio.create_task(scraper.run(), name="load"))
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: background(self.reloadable, self.reload("SIGHUP")))
        log.info("backends at start: %s", ", ".join(
            f"{b.name}={b.state.value}" for b in self.pool.backends))
        try:
            yield
        finally:
            for task in loops:
                task.cancel()
            for job in list(self.reloadable.background):
                job.cancel()  # sequential starts and reload drains
            await asyncio.gather(*loops, *self.reloadable.background, return_exceptions=True)
            await asyncio.gather(*(s.stop() for s in parts.supervisors.values()))
            await parts.upstream.aclose()
            await parts.probe.aclose()

    async def reload(self, who: str) -> dict[str, Any]:
        """Read the config file again and apply what can change while running.

        Raises NoConfigPath or ReloadRefused (AdminErrors); the running config stays."""
        if self.config_path is None:
            raise NoConfigPath("the config path is unknown")
        try:
            new = await asyncio.to_thread(load, self.config_path)
        except ConfigError as exc:
            log.error("config reload by %s refused, the running config stays:\n%s", who,
                      "\n".join(exc.problems))
            raise ReloadRefused("invalid config; the running config stays",
                                exc.problems) from None
        summary = await apply(self.reloadable, self.config, new, who)
        self.config = new
        return {"reloaded": True, **summary}

    async def _models(self, request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "vllm-gateway"}
            for m in self.pool.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _metrics(self, request: Request) -> Response:
        self.status.refresh()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _refresh(self, every: float = 1.0) -> None:
        while True:  # other workers' gauges, in multiprocess mode, come from here
            self.status.refresh()
            await asyncio.sleep(every)

    async def _dashboard(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD, headers={"cache-control": "no-store"})

    async def _dashboard_data(self, request: Request) -> Response:
        return JSONResponse(self.status.data())

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "pid": os.getpid()})

    async def _readyz(self, request: Request) -> Response:
        ready = self.pool.ready
        return JSONResponse(
            {"ready": ready, "backends": {b.name: b.state.value for b in self.pool.backends}},
            status_code=200 if ready else 503,
        )


def from_env() -> GatewayApp:
    """The app factory each worker process calls (config path from the environment)."""
    config = load(os.environ[CONFIG_ENV])
    if not logging.getLogger().handlers:  # a spawned worker: logging is not set up yet
        logs.setup(config.gateway.log_level, StreamAborted, fmt=config.gateway.log_format)
    return GatewayApp(config)
