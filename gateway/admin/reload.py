"""Config hot reload: backends, groups, model names and canary settings, without dropping
a stream. An invalid file is refused with the same ``dotted.key: message`` report and the
running config stays.

Backends are matched by name. An unchanged one keeps its state; a new one starts like at
start-up; a removed one is taken out of rotation at once (requests already on it finish;
a spawned one is drained, then stopped); a changed one is both. Settings that only a
restart can apply (listen address, workers, Redis, timeouts...) are reported, not applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.backend import Backend
from backends.discovery import Discovery
from backends.health import HealthChecker
from backends.supervisor import Supervisor
from gateway.canary.rollout import Canary, Phase
from gateway.config import Config, ConfigError, load
from gateway.errors import GatewayError, NoConfigPath, ReloadRefused
from gateway.resilience.breaker import Breakers
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.tenants.keyring import Keyring

log = logging.getLogger("gateway.reload")

APPLIED = ("backends", "models", "canary", "keys")  # and gateway.api_keys


@dataclass
class Reloadable:
    """The parts of a running gateway a reload may change."""

    pool: BackendPool
    breakers: Breakers
    canary: Canary
    supervisors: dict[str, Supervisor]
    make_supervisor: Callable[[Backend], Supervisor] | None  # None: another process does
    checker: HealthChecker | None = None
    keyring: Keyring | None = None
    queue: WaitQueue | None = None
    background: set[asyncio.Future[object]] = field(default_factory=set)


class Reloader:
    """Reads the config file again and applies what can change while running; resolves
    the ``discover`` entries again (``rediscover``) and applies what they now stand for."""

    def __init__(self, parts: Reloadable, config: Config, path: str | None,
                 discovery: Discovery | None = None) -> None:
        self._parts = parts
        self.config = config  # the running config, replaced by each reload that applies
        self.path = path
        self.discovery = discovery or Discovery()
        self._lock = asyncio.Lock()  # one apply at a time: a reload or a rediscovery
        self.text: str | None = None  # the file as the last reload that applied read it
        self.version = 0  # reloads applied

    @property
    def discovers(self) -> bool:
        return any(spec.discover is not None for spec in self.config.backends)

    async def __call__(self, who: str, text: str | None = None,
                       version: int | None = None) -> dict[str, Any]:
        """Read the file (or take ``text``, the control process's reading of it, its
        ``version``-th reload: an older one than applied already is passed over) and apply
        it. Raises NoConfigPath or ReloadRefused (AdminErrors); the running config stays."""
        if self.path is None:
            raise NoConfigPath("the config path is unknown")
        try:
            if text is None:
                text = await asyncio.to_thread(_read, self.path)
            new = await asyncio.to_thread(load, self.path, None, text)
        except ConfigError as exc:
            log.error("config reload by %s refused, the running config stays:\n%s", who,
                      "\n".join(exc.problems))
            raise ReloadRefused("invalid config; the running config stays",
                                exc.problems) from None
        async with self._lock:
            if version is not None and version <= self.version:
                return {"reloaded": False}  # a later one was applied meanwhile
            summary = await apply(self._parts, self.config, await self._expanded(new), who)
            self.config = new
            self.text = text
            self.version = version if version is not None else self.version + 1
        return {"reloaded": True, **summary}

    async def rediscover(self) -> None:
        """Look the ``discover`` names up again; apply only when the backends they stand
        for changed (a new address starts like a new backend; a gone one is drained)."""
        async with self._lock:
            expanded = await self._expanded(self.config)
            if {s.name: s for s in expanded.backends} != {
                    b.name: b.spec for b in self._parts.pool.backends}:
                await apply(self._parts, self.config, expanded, "discovery")

    async def _expanded(self, config: Config) -> Config:
        backends = tuple(await self.discovery.expand(config.backends))
        return config.model_copy(update={"backends": backends})


async def apply(parts: Reloadable, old: Config, new: Config, who: str) -> dict[str, object]:
    before = {b.name: b for b in parts.pool.backends}
    wanted = {spec.name: spec for spec in new.backends}
    kept, added, removed = [], [], []
    backends: list[Backend] = []
    for spec in new.backends:
        current = before.get(spec.name)
        if current is not None and current.spec == spec:
            backends.append(current)
            kept.append(spec.name)
            continue
        if current is not None:
            removed.append(current)
        backend = Backend(spec)
        backends.append(backend)
        added.append(backend)
    removed += [b for name, b in before.items() if name not in wanted]
    parts.pool.replace(backends)
    parts.pool.remap(new.models)
    parts.pool.adapters.declare(new.adapters, new.routing.adapter_affinity)
    retiring = {b.name: _retire(parts, b) for b in removed}
    for backend in added:
        parts.breakers.add(backend.name)
        if backend.managed:
            _start_after(parts, backend, retiring.get(backend.name))
    if parts.checker is not None and added:
        await parts.checker.check_all()  # new url backends route at once, not after a tick
    _canary(parts.canary, old, new, who)
    _keys(parts, new)
    # The keys (api_keys included) apply; any other change in [gateway] needs a restart.
    same_keys = old.model_copy(update={"gateway": old.gateway.model_copy(
        update={"api_keys": new.gateway.api_keys})})
    later = sorted(k for k in type(new).model_fields
                   if k not in APPLIED and getattr(same_keys, k) != getattr(new, k))
    summary: dict[str, object] = {
        "kept": kept, "added": [b.name for b in added], "removed": [b.name for b in removed],
        "needs_restart": later}
    log.warning("config reloaded by %s: %s", who, summary)
    return summary


def _retire(parts: Reloadable, backend: Backend) -> asyncio.Future[object] | None:
    supervisor = parts.supervisors.pop(backend.name, None)
    if supervisor is None:
        backend.stop()
        return None
    return background(parts, supervisor.drain_and_stop())


def _start_after(parts: Reloadable, backend: Backend,
                 predecessor: asyncio.Future[object] | None) -> None:
    if parts.make_supervisor is None:
        return  # a serving worker: the control process starts it, the link says when
    supervisor = parts.make_supervisor(backend)
    parts.supervisors[backend.name] = supervisor
    if supervisor.waits_for_demand():
        return

    async def start() -> None:
        if predecessor is not None:
            await predecessor  # the old process holds the port until it stopped
        supervisor.start()

    background(parts, start())


def background(parts: Reloadable, coro: Coroutine[Any, Any, object]) -> asyncio.Future[object]:
    """Run ``coro`` as a task the app cancels at shutdown."""
    task = asyncio.ensure_future(coro)
    parts.background.add(task)
    task.add_done_callback(lambda done: _finished(parts, done))
    return task


def _finished(parts: Reloadable, task: asyncio.Future[object]) -> None:
    parts.background.discard(task)
    exc = None if task.cancelled() else task.exception()
    if isinstance(exc, GatewayError):  # a refused reload on SIGHUP: said when refused
        log.warning("%s", exc.message)
    elif exc is not None:
        log.error("a background job failed", exc_info=exc)


def _keys(parts: Reloadable, new: Config) -> None:
    if parts.keyring is not None:
        parts.keyring.replace(new.keys, new.gateway.api_keys)
        if parts.queue is not None:
            parts.queue.tenants(len(parts.keyring.tenants))


def _canary(canary: Canary, old: Config, new: Config, who: str) -> None:
    canary.reconfigure(new.canary)
    if new.canary.weight != old.canary.weight:
        canary.change(who, "config reload", weight=new.canary.weight,
                      phase=Phase.MANUAL, step=-1)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None
