"""Wires config, pool, upstream client, health checks and routes into one ASGI app.

Nothing imports this module except the CLI.
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

import aiohttp
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backends.backend import Backend
from backends.health import HealthChecker, HttpProbe
from backends.supervisor import Supervisor, start_in_turn
from backends.vllm_metrics import LoadScraper, Nvml
from gateway.admin.backends import Admin
from gateway.admin.canary import CanaryAdmin
from gateway.admin.reload import Reloadable, apply, background
from gateway.canary.arms import Arms, ArmStore
from gateway.canary.rollout import Canary
from gateway.canary.sync import CanarySync
from gateway.config import CONFIG_ENV, Config, ConfigError, load
from gateway.errors import StreamAborted, error_body
from gateway.http.asgi import request_id, send_json
from gateway.http.auth import ApiKeyAuth
from gateway.http.framing import Http10Framing
from gateway.metrics import Metrics
from gateway.observability import logs
from gateway.observability.status import Status
from gateway.proxy import Proxy
from gateway.resilience.breaker import Breakers, MetricsListener
from gateway.resilience.breaker_sync import BreakerSync
from gateway.resilience.degraded import Degraded
from gateway.resilience.replies import ReplyCache
from gateway.routing.names import ModelNames
from gateway.routing.pins import PinStore
from gateway.routing.policies import make_policy
from gateway.routing.pool import BackendPool
from gateway.routing.router import Router
from gateway.state.embedded import EmbeddedRedisError, EmbeddedValkey, refuse_to_start
from gateway.state.link import RedisLink
from gateway.upstream import make_upstream

log = logging.getLogger("gateway")

DASHBOARD = (Path(__file__).parent / "observability" / "dashboard.html").read_text(encoding="utf-8")
PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class GatewayApp:
    """The ASGI app. OpenAI POST routes go straight to the proxy; the rest to Starlette."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.breakers = Breakers(config.breaker, [spec.name for spec in config.backends],
                                 [MetricsListener(self.metrics)])
        self.pool = BackendPool([Backend(spec) for spec in config.backends],
                                self.breakers.allows, ModelNames(config.models))
        self.upstream = make_upstream(config.upstream)
        self.canary = Canary(config.canary, self.metrics)
        self.canary_sync: CanarySync | None = None
        self.router = Router(self.pool, make_policy(config.routing), None, config.routing,
                             self.metrics, self.breakers,
                             make_policy(config.routing, config.routing.pin_policy))
        self.arms = Arms(self.pool, self.canary)
        self.replies = ReplyCache(config.degraded, dropped=self.metrics.reply_cache_dropped)
        degraded = Degraded(config.degraded, self.replies, self.metrics)
        self.proxy = Proxy(config, self.pool, self.upstream, self.router, degraded, self.metrics,
                           self.canary, self.arms)
        self.supervisors: dict[str, Supervisor] = {}
        admin_key = config.gateway.admin_key
        self.admin = Admin(self.pool, self.supervisors, self.breakers,
                           admin_key.get_secret_value() if admin_key else None,
                           config.supervisor.drain_timeout)
        self.canary_admin = CanaryAdmin(self.canary, self.admin.guard, self.reload)
        self.reloadable = Reloadable(self.pool, self.breakers, self.canary, self.supervisors,
                                     self._supervisor)
        self.config_path = os.environ.get(CONFIG_ENV)
        self.status = Status(self.pool, self.breakers, self.canary, self.router, degraded,
                             self.supervisors, self.metrics)
        self._other = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/dashboard", self._dashboard, methods=["GET"]),
                Route("/dashboard/data", self.admin.guard(self._dashboard_data),
                      methods=["GET"]),
                *self.admin.routes(),
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
                await self.proxy(scope, receive, send)
            else:
                body = error_body("use POST", "invalid_request_error", "method_not_allowed")
                await send_json(send, 405, body, request_id(scope), [(b"allow", b"POST")])
            return
        await self._other(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if self.config.uses_redis:
                await stack.enter_async_context(self._shared_state())
            await stack.enter_async_context(self._backends())
            yield

    @contextlib.asynccontextmanager
    async def _shared_state(self) -> AsyncIterator[None]:
        """Pins, breaker openings and cached replies, all through one Redis link."""
        async with self._redis() as link:
            if self.config.routing.sticky:
                self.router.store = PinStore(link, self.config.routing.session_ttl)
            if self.config.degraded.cache:
                self.replies.link = link
            tasks = []
            breaker = self.config.breaker
            if breaker.enabled and breaker.share:
                tasks.append(asyncio.create_task(BreakerSync(
                    link, self.breakers, breaker.reset_timeout, breaker.sync_interval).run(),
                    name="breaker-sync"))
            # Always, not only when the canary is on at start: a reload may turn it on.
            self.arms.store = ArmStore(link, self.config.routing.session_ttl)
            self.canary_sync = CanarySync(link, self.canary)
            self.canary_admin.publish = self.canary_sync.publish
            if self.canary.enabled:
                await self.canary_sync.sync_once()  # the shared state before any request
            tasks.append(asyncio.create_task(self.canary_sync.run(), name="canary-sync"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.replies.aclose()

    @contextlib.asynccontextmanager
    async def _redis(self) -> AsyncIterator[RedisLink]:
        settings = self.config.redis
        embedded = None
        url = settings.url
        if url == "embedded":
            embedded = EmbeddedValkey(settings.embedded_log, settings.data_dir)
            try:
                await embedded.start()
            except EmbeddedRedisError as exc:
                refuse_to_start(f"{self.config_path or 'config'}: {exc.key}: {exc}")
            url = embedded.url
            log.info("embedded valkey on %s, data in %s", url, embedded.data_dir)
        client = aioredis.from_url(
            # The link bounds every call (connecting included) by redis.timeout itself,
            # forgiving loop lag; socket timeouts of redis-py's own would count that lag.
            url, socket_timeout=None, socket_connect_timeout=None,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        link = RedisLink(client, settings.key_prefix, settings.retry_interval, self.metrics,
                         timeout=settings.timeout)
        try:
            yield link
        finally:
            await link.aclose()
            if embedded is not None:
                await embedded.stop()

    @contextlib.asynccontextmanager
    async def _backends(self) -> AsyncIterator[None]:
        settings = self.config.health
        async with aiohttp.ClientSession() as probe_session:
            probe = HttpProbe(probe_session, settings.timeout)
            self._probe = probe
            for backend in self.pool.backends:
                if backend.managed:
                    self.supervisors[backend.name] = self._supervisor(backend)
            if self.config.supervisor.sequential_start:
                background(self.reloadable, start_in_turn(list(self.supervisors.values())))
            else:
                for supervisor in self.supervisors.values():
                    supervisor.start()
            checker = HealthChecker(self.pool.backends, settings, probe)
            self.reloadable.checker = checker
            await checker.check_all()
            loops: list[asyncio.Future[None]] = [
                asyncio.create_task(checker.run(), name="health"),
                asyncio.create_task(self._refresh(), name="gauges")]
            if settings.metrics_interval > 0:
                nvml = None
                if any(b.spec.monitored_gpus for b in self.pool.backends):
                    nvml = await asyncio.to_thread(Nvml)
                scraper = LoadScraper(self.pool.backends, probe_session,
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
                await asyncio.gather(*loops, *self.reloadable.background,
                                     return_exceptions=True)
                await asyncio.gather(*(s.stop() for s in self.supervisors.values()))
                await self.upstream.aclose()

    def _supervisor(self, backend: Backend) -> Supervisor:
        return Supervisor(backend, self.config.supervisor, self._probe)

    async def reload(self, who: str) -> dict[str, Any]:
        """Read the config file again and apply what can change while running.

        Raises NoConfigPath or ReloadRefused (AdminErrors); the running config stays."""
        from gateway.errors import NoConfigPath, ReloadRefused

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
