"""Spawned instances started and stopped by demand (issue 39, before sleep mode): a backend
with ``start = "on_demand"`` is not started at boot but at its model's first request, and
one with ``stop_after`` is drained and stopped once no request has gone to it for that
long, then started again on demand. The control plane owns it for every serving process:
they tell it the models their requests wait for (``gateway.request.waking``) and how many
attempts they sent each backend, a few times a second.

One start per wanted model at a time: a model with an instance up or starting starts no
other. A stopped on-demand instance is started when its model is asked for, whoever
stopped it (the gateway owns its life); a failed one stays failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from backends.backend import Backend, BackendState
from backends.supervisor import Supervisor
from gateway.routing.pool import BackendPool

log = logging.getLogger("gateway.demand")

UP = (BackendState.READY, BackendState.STARTING, BackendState.UNHEALTHY)


class Demand:
    def __init__(self, pool: BackendPool, supervisors: Mapping[str, Supervisor],
                 uses: Callable[[], dict[str, int]], wanted: Callable[[], set[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._supervisors = supervisors
        self._uses = uses
        self._wanted = wanted
        self._clock = clock
        self._seen: dict[str, int] = {}  # each backend's attempts at the last look
        self._active: dict[str, float] = {}  # when each was last seen in use (or started)
        self._stopping: dict[str, asyncio.Task[bool]] = {}
        self.starts = 0
        self.stops = 0

    def look(self) -> None:
        """Start an instance for each model waited for; stop those idle too long."""
        for model in sorted(self._wanted()):
            self._start_one(model)
        now, uses = self._clock(), self._uses()
        for backend in self._pool.backends:
            spawn = backend.spec.spawn
            if spawn is None or spawn.stop_after is None:
                continue
            if backend.state is not BackendState.READY:  # its idle time starts when it is
                self._active.pop(backend.name, None)
                self._seen.pop(backend.name, None)
                continue
            used = uses.get(backend.name, backend.uses)
            if (backend.in_flight or used != self._seen.get(backend.name)
                    or backend.name not in self._active):
                self._seen[backend.name], self._active[backend.name] = used, now
            elif now - self._active[backend.name] >= spawn.stop_after:
                self._stop(backend, now - self._active[backend.name])

    def _start_one(self, model: str) -> None:
        candidates = self._pool.demanded(model)
        if any(b.state in UP for b in candidates):
            return
        for backend in candidates:
            supervisor = self._supervisors.get(backend.name)
            if (backend.name not in self._stopping and backend.state is BackendState.STOPPED
                    and supervisor is not None):
                log.info("backend %s: started for model %s, asked while it was stopped",
                         backend.name, model)
                self._active.pop(backend.name, None)
                if supervisor.start():
                    backend.start_over()
                self.starts += 1
                return

    def _stop(self, backend: Backend, idle: float) -> None:
        supervisor = self._supervisors.get(backend.name)
        if supervisor is None or backend.name in self._stopping:
            return
        log.info("backend %s: no request for %.0f s; stopped until its model is asked for",
                 backend.name, idle)
        self.stops += 1
        self._active.pop(backend.name, None)
        task = asyncio.get_running_loop().create_task(supervisor.drain_and_stop(),
                                                      name=f"idle stop {backend.name}")
        self._stopping[backend.name] = task

        task.add_done_callback(lambda _: self._stopping.pop(backend.name, None))

    async def run(self, every: float = 0.2) -> None:
        while True:
            self.look()
            await asyncio.sleep(every)
