"""The batch API's parts in a serving process: its routes and its runner (which runs only
while this process holds the deployment's lease)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp

from gateway.batch.routes import BatchApi
from gateway.batch.runner import Runner
from gateway.batch.store import Store
from gateway.config.batch import BatchSection
from gateway.metrics import Metrics
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.state.link import RedisLink
from gateway.tenants.keyring import Keyring


@dataclass(frozen=True)
class BatchService:
    api: BatchApi
    runner: Runner


def make(settings: BatchSection, data_dir: str, idle: float, link: RedisLink | None,
         proxy: ASGIApp, pool: BackendPool, queue: WaitQueue, keyring: Keyring,
         metrics: Metrics) -> BatchService | None:
    """None when off, or without Redis (the records live there). The files go to
    ``settings.dir``, else ``batch`` beside Redis's ``data_dir``; an upload that sends
    nothing for ``idle`` seconds is refused."""
    if not settings.enabled or link is None:
        return None
    store = Store(link, settings.dir or str(Path(data_dir).parent / "batch"))
    return BatchService(BatchApi(store, settings, idle, keyring.name_of),
                        Runner(store, proxy, pool, queue, lambda: keyring,
                               settings.concurrency, metrics))
