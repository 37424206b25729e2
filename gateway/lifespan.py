"""The lifespan: starts what ``gateway.build`` built, in order, and stops it in reverse.

Shared state first (the embedded valkey, the Redis link, breaker and canary sync), then the
backends (supervisors, health checks, load scrapes) and the gauges; SIGHUP reloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp

from backends.backend import BackendState
from backends.supervisor import start_in_turn
from backends.vllm_metrics import LoadScraper, Nvml
from gateway.admin.reload import background
from gateway.build import Parts, SharedState
from gateway.config import Config
from gateway.control.role import Kind
from gateway.http.server import EVICTED, REFUSED
from gateway.state.embedded import EmbeddedRedisError, EmbeddedValkey, refuse_to_start

LIVE = (BackendState.READY, BackendState.DRAINING)  # states whose KV cache is followed

log = logging.getLogger("gateway")


class Lifespan:
    def __init__(self, parts: Parts, config: Config) -> None:
        self._parts = parts
        self._config = config  # as at start: what a reload changes is applied by it

    @contextlib.asynccontextmanager
    async def __call__(self, app: object) -> AsyncIterator[dict[str, object]]:
        """Yields the server's state: what its connections count (gateway.http.server)."""
        async with contextlib.AsyncExitStack() as stack:
            if self._parts.shared is not None:
                await stack.enter_async_context(self._shared_state(self._parts.shared))
            await stack.enter_async_context(self._backends())
            yield {REFUSED: self._parts.metrics.connections_refused,
                   EVICTED: self._parts.metrics.connections_evicted}

    @contextlib.asynccontextmanager
    async def _shared_state(self, shared: SharedState) -> AsyncIterator[None]:
        """Pins, arms, breaker openings, cached replies and the canary, through one link
        (the control process only runs the embedded server, for its workers)."""
        if shared.embedded is not None:
            await self._embedded(shared.embedded)
        if self._parts.role.kind is Kind.CONTROL:
            try:
                yield
            finally:
                if shared.embedded is not None:
                    await shared.embedded.stop()
            return
        shared.link.open()
        await shared.link.warm()
        tasks = []
        if shared.breaker_sync is not None:
            tasks.append(asyncio.create_task(shared.breaker_sync.run(), name="breaker-sync"))
        if self._parts.canary.enabled:
            await shared.canary_sync.sync_once()  # the shared state before any request
        tasks.append(asyncio.create_task(shared.canary_sync.run(), name="canary-sync"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._parts.serving is not None:
                await self._parts.serving.replies.aclose()
            await shared.link.aclose()
            if shared.embedded is not None:
                await shared.embedded.stop()

    async def _embedded(self, embedded: EmbeddedValkey) -> None:
        try:
            await embedded.start()
        except EmbeddedRedisError as exc:
            path = self._parts.operators.reloader.path
            refuse_to_start(f"{path or 'config'}: {exc.key}: {exc}")
        log.info("embedded valkey on %s, data in %s", embedded.url, embedded.data_dir)

    @contextlib.asynccontextmanager
    async def _backends(self) -> AsyncIterator[None]:
        parts, reloadable = self._parts, self._parts.reloadable
        supervisors = [s for s in parts.supervisors.values() if not s.waits_for_demand()]
        if self._config.supervisor.sequential_start:
            background(reloadable, start_in_turn(supervisors))
        else:
            for supervisor in supervisors:
                supervisor.start()
        loops = await self._loops()
        reload = parts.operators.reload
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: background(reloadable, reload("SIGHUP")))
        log.info("backends at start: %s", ", ".join(
            f"{b.name}={b.state.value}" for b in parts.pool.backends))
        try:
            yield
        finally:
            for task in loops:
                task.cancel()
            for job in list(reloadable.background):
                job.cancel()  # sequential starts and reload drains
            await asyncio.gather(*loops, *reloadable.background, return_exceptions=True)
            if parts.demand is not None:
                await parts.demand.aclose()  # its sleeps, wakes and idle stops under way
            await asyncio.gather(*(s.stop() for s in parts.supervisors.values()))
            if parts.serving is not None:
                await parts.serving.upstream.aclose()
            await parts.probe.aclose()
            if parts.link is not None:
                await parts.link.aclose()

    async def _loops(self) -> list[asyncio.Task[None]]:
        """The control plane's (one process alone, or the control process): discovery,
        health checks and load scrapes; a serving process's: the gauges; and a worker's, the
        control link, whose snapshot replaces the checks and scrapes. A worker also resolves
        the discovered names, which tell it what backends there are."""
        parts, kind = self._parts, self._parts.role.kind
        if parts.link is not None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError,
                                     KeyError):
                await parts.link.sync_once()  # the backends' states before serving
        reloader = parts.operators.reloader
        if reloader.discovers:  # the backends DNS names stand for, before serving
            await reloader.rediscover()
            if parts.link is not None:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError,
                                         ValueError, KeyError):
                    await parts.link.sync_once()
        loops = [asyncio.create_task(self._discover(), name="discovery")
                 ] if reloader.discovers else []
        if parts.link is None:  # the control plane
            await parts.checker.check_all()
            loops += [asyncio.create_task(parts.checker.run(), name="health"),
                      *await self._load_scraper()]
            if parts.demand is not None:
                loops.append(asyncio.create_task(parts.demand.run(), name="demand"))
        else:
            loops.append(asyncio.create_task(parts.link.run(), name="control-link"))
        if kind is not Kind.CONTROL:
            loops.append(asyncio.create_task(parts.operators.ops.refresh(), name="gauges"))
        if parts.serving is not None:  # LoRA adapters preloaded, and removed ones unloaded
            loops.append(asyncio.create_task(parts.pool.adapters.upkeep(
                lambda: parts.pool.backends, parts.serving.upstream,
                self._config.health.interval), name="adapters"))
        if parts.batch is not None:  # runs batches while this process holds the lease
            loops.append(asyncio.create_task(parts.batch.runner.run(), name="batch-runner"))
        if parts.kv is not None:  # the events followed, or (a worker) the control's index
            # An instance that went down (it may come back restarted, its cache empty) has
            # its feed stopped and its blocks dropped; back, its feed starts in step again.
            pool = parts.pool
            loops.append(asyncio.create_task(parts.kv.run(lambda: {
                b.name: e for b in pool.backends
                if (e := b.spec.kv_endpoints) is not None and b.state in LIVE}),
                name="kv-feeds"))
        return loops

    async def _discover(self) -> None:
        """Resolve the ``discover`` names every ``health.discover_interval`` (a reload may
        add or remove such entries: the loop runs while any is configured at start)."""
        reloader, link = self._parts.operators.reloader, self._parts.link
        while True:
            interval = self._config.health.discover_interval
            if link is not None:  # a worker: as soon as its control process found a change
                await link.discovery_changed(interval)
            else:
                await asyncio.sleep(interval)
            try:
                await reloader.rediscover()
            except Exception:  # a bad round must not end discovery
                log.exception("backend discovery failed; trying again")

    async def _load_scraper(self) -> list[asyncio.Task[None]]:
        """The task scraping vLLM's /metrics (and the GPUs), when enabled."""
        settings, backends = self._config.health, self._parts.pool.backends
        if settings.metrics_interval <= 0:
            return []
        nvml = None
        if any(b.spec.monitored_gpus for b in backends):
            nvml = await asyncio.to_thread(Nvml)
        scraper = LoadScraper(backends, self._parts.probe.session, settings.metrics_interval,
                              settings.timeout, nvml, self._parts.status.loaded)
        return [asyncio.create_task(scraper.run(), name="load")]
