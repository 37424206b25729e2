"""Active health checks: probe every backend on an interval, flip state on fall/rise."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from backends.backend import Backend

log = logging.getLogger("backends.health")


class HealthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: float = Field(default=5.0, gt=0, description="seconds between probes")
    timeout: float = Field(default=2.0, gt=0, description="seconds one probe may take")
    fall: int = Field(default=3, ge=1, description="failed probes in a row to leave rotation")
    rise: int = Field(default=2, ge=1, description="good probes in a row to re-enter rotation")
    # vLLM's own load report (/metrics): requests running and waiting, KV-cache use, prefix
    # cache hits. 0 = don't scrape (the policy then counts only the gateway's in-flight).
    metrics_interval: float = Field(default=2.0, ge=0)
    # How often a [[backends]] discover name is resolved again (backends.discovery).
    discover_interval: float = Field(default=5.0, gt=0)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    models: frozenset[str] | None = None
    cards: dict[str, dict[str, Any]] | None = None  # vLLM's /v1/models entries, by id


Probe = Callable[[Backend], Awaitable[ProbeResult]]


class HttpProbe:
    """``GET /health``, then ``GET /v1/models`` to learn what the backend serves."""

    def __init__(self, timeout: float) -> None:
        self._session_: aiohttp.ClientSession | None = None  # opened on first use, in a loop
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The probes' HTTP session (shared with the load scraper)."""
        if self._session_ is None:
            self._session_ = aiohttp.ClientSession()
        return self._session_

    async def aclose(self) -> None:
        if self._session_ is not None:
            await self._session_.close()
            self._session_ = None

    @staticmethod
    def _headers(backend: Backend) -> dict[str, str]:
        if backend.spec.api_key is None:
            return {}
        return {"Authorization": f"Bearer {backend.spec.api_key.get_secret_value()}"}

    async def version(self, backend: Backend) -> str | None:
        """The backend's ``GET /version`` (vLLM's version), or None when it does not say."""
        try:
            async with self.session.get(backend.url + "/version", headers=self._headers(backend),
                                        timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                version = orjson.loads(await resp.read()).get("version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        return version[:64] if isinstance(version, str) else None

    async def __call__(self, backend: Backend) -> ProbeResult:
        headers = self._headers(backend)
        try:
            async with self.session.get(
                backend.url + "/health", headers=headers, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    return ProbeResult(ok=False)
            async with self.session.get(
                backend.url + "/v1/models", headers=headers, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    return ProbeResult(ok=False)
                payload = orjson.loads(await resp.read())
            cards = {str(m["id"]): m for m in payload.get("data", []) if isinstance(m, dict)}
            return ProbeResult(ok=True, models=frozenset(cards), cards=cards)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return ProbeResult(ok=False)


class HealthChecker:
    """Runs ``probe`` against every backend each ``interval`` seconds."""

    def __init__(
        self,
        backends: Sequence[Backend],
        settings: HealthSettings,
        probe: Probe,
        on_change: Callable[[Backend], None] | None = None,
    ) -> None:
        self._backends = backends
        self._settings = settings
        self._probe = probe
        self._on_change = on_change

    async def check_all(self) -> None:
        backends = list(self._backends)  # the list may change (config reload) while we wait
        results = await asyncio.gather(*(self._probe(b) for b in backends))
        for backend, result in zip(backends, results, strict=True):
            self.apply(backend, result)

    def apply(self, backend: Backend, result: ProbeResult) -> None:
        if result.models is not None:
            backend.learn(result.models, result.cards)
        backend.last_probe = "ok" if result.ok else "failed"
        before = backend.state
        if backend.observe_probe(result.ok, self._settings.fall, self._settings.rise):
            log.warning(
                "backend %s: %s -> %s", backend.name, before.value, backend.state.value
            )
            if self._on_change is not None:
                self._on_change(backend)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.interval)
            await self.check_all()
