"""Spawned instances started, stopped, put to sleep and woken by demand (issue 39). The
control plane owns each instance's life for every serving process: they tell it the models
their requests wait for (``gateway.request.waking``) and how many attempts they sent each
backend, a few times a second.

- ``start = "on_demand"``: not started at boot (``Supervisor.waits_for_demand``) but at its
  model's first request.
- ``sleep_after``: idle that long, it is drained and put to sleep (``gateway.control.sleep``);
  a request for its model wakes it, and its answer to a temperature-0 check must equal the
  one it gave when it first became ready, or it is restarted cold.
- ``stop_after``: idle that long (asleep or not), it is drained and stopped.

One start or wake per wanted model at a time: a model with an instance up, starting or
waking starts no other. A stopped on-demand instance is started when its model is asked
for, whoever stopped it (the gateway owns its life); a failed one stays failed. Every
change of state is logged and counted with the time spent in the state left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from backends.backend import Backend, BackendState
from backends.supervisor import Supervisor
from gateway.control.room import to_make_room
from gateway.control.sleep import Sleeper
from gateway.metrics import LifecycleCounts
from gateway.routing.pool import BackendPool

log = logging.getLogger("gateway.demand")

UP = (BackendState.READY, BackendState.STARTING, BackendState.UNHEALTHY,
      BackendState.WAKING, BackendState.VERIFYING)
IDLE = (BackendState.READY, BackendState.ASLEEP)  # states whose idle time counts
COMING = ("wake", "start")  # jobs that bring an instance up


class Demand:
    def __init__(self, pool: BackendPool, supervisors: Mapping[str, Supervisor],
                 uses: Callable[[], dict[str, int]], wanted: Callable[[], set[str]],
                 clock: Callable[[], float] = time.monotonic,
                 sleeper: Sleeper | None = None) -> None:
        self._pool = pool
        self._supervisors = supervisors
        self._uses = uses
        self._wanted = wanted
        self._clock = clock
        self._moves: Counter[tuple[str, str, str]] = Counter()  # (backend, from, to)
        self._spent: dict[tuple[str, str], list[float]] = {}  # (backend, state): [n, seconds]
        self._checks: Counter[tuple[str, str]] = Counter()  # (backend, result)
        self.sleeper = sleeper or Sleeper()
        self._seen: dict[str, int] = {}  # each backend's attempts at the last look
        self._active: dict[str, float] = {}  # when each was last seen in use (or started)
        self._busy: dict[str, asyncio.Task[Any]] = {}  # a stop, sleep, wake or check under way
        self._doing: dict[str, str] = {}  # which
        self._answers: dict[str, tuple[int | None, str]] = {}  # (pid, answer at first ready)
        self.starts = self.stops = self.sleeps = self.wakes = self.cold_restarts = 0

    def look(self) -> None:
        """Start or wake an instance for each model waited for; put to sleep or stop those
        idle too long; record each sleeper's answer once it is first ready."""
        for backend in self._pool.backends:
            if backend.transitions is None:
                backend.transitions = self._changed
        for model in sorted(self._wanted()):
            self._start_one(model)
        now, uses = self._clock(), self._uses()
        for backend in self._pool.backends:
            spawn = backend.spec.spawn
            if spawn is None or not spawn.on_demand:
                continue
            if backend.state not in IDLE:  # its idle time starts again when it is back
                self._active.pop(backend.name, None)
                self._seen.pop(backend.name, None)
                continue
            self._remember(backend)
            used = uses.get(backend.name, backend.uses)
            if (backend.in_flight or used != self._seen.get(backend.name)
                    or backend.name not in self._active):
                self._seen[backend.name], self._active[backend.name] = used, now
                continue
            idle = now - self._active[backend.name]
            if spawn.stop_after is not None and idle >= spawn.stop_after:
                self._stop(backend, idle)
            elif (spawn.sleep_after is not None and idle >= spawn.sleep_after
                  and backend.state is BackendState.READY):
                self._begin(backend, self._sleep(backend, spawn.sleep_level, idle), "sleep")

    def _start_one(self, model: str) -> None:
        candidates = self._pool.demanded(model)
        if any(b.state in UP or self._doing.get(b.name) in COMING for b in candidates):
            return
        for backend in candidates:
            if backend.name in self._busy:
                continue
            supervisor = self._supervisors.get(backend.name)
            if backend.state is BackendState.ASLEEP:
                self._begin(backend, self._wake(backend, model), "wake")
                return
            if backend.state is BackendState.STOPPED and supervisor is not None:
                log.info("backend %s: started for model %s, asked while it was stopped",
                         backend.name, model)
                self._active.pop(backend.name, None)
                if self._crowded(backend):
                    self._begin(backend, self._start_in_room(backend, supervisor), "start")
                elif supervisor.start():
                    backend.start_over()
                    self.starts += 1
                return

    def _crowded(self, backend: Backend) -> list[Backend]:
        """Who must sleep or stop first for ``backend`` to fit on its GPUs (``room``)."""
        return [b for b in to_make_room(self._pool.backends, backend,
                                        lambda b: self._active.get(b.name, 0.0))
                if b.name not in self._busy]

    async def _make_room(self, backend: Backend) -> None:
        for other in self._crowded(backend):
            spawn, supervisor = other.spec.spawn, self._supervisors.get(other.name)
            if spawn is None or supervisor is None:
                continue
            log.info("backend %s: makes room on its GPUs for %s", other.name, backend.name)
            if spawn.sleep_after is not None:
                await self._sleep(other, spawn.sleep_level, 0.0)
            else:
                self.stops += 1
                await supervisor.drain_and_stop()

    async def _start_in_room(self, backend: Backend, supervisor: Supervisor) -> None:
        await self._make_room(backend)
        if supervisor.start():
            backend.start_over()
            self.starts += 1

    def _begin(self, backend: Backend, job: Coroutine[Any, Any, object], what: str) -> None:
        if backend.name in self._busy:
            job.close()
            return
        task = asyncio.get_running_loop().create_task(self._guarded(backend, job, what),
                                                      name=f"{what} {backend.name}")
        self._busy[backend.name], self._doing[backend.name] = task, what
        task.add_done_callback(lambda _: self._done(backend.name))

    async def _guarded(self, backend: Backend, job: Coroutine[Any, Any, object],
                       what: str) -> None:
        """A job that fails leaves no instance half woken or half asleep."""
        try:
            await job
        except Exception:
            log.exception("backend %s: the %s failed", backend.name, what)
            if backend.state in (BackendState.WAKING, BackendState.VERIFYING):
                await self._cold(backend, "failed", "its wake failed")
            elif backend.state is BackendState.DRAINING and what == "sleep":
                backend.mark_ready()

    def _done(self, name: str) -> None:
        self._busy.pop(name, None)
        self._doing.pop(name, None)

    def _stop(self, backend: Backend, idle: float) -> None:
        supervisor = self._supervisors.get(backend.name)
        if supervisor is None or backend.name in self._busy:
            return
        log.info("backend %s: no request for %.0f s; stopped until its model is asked for",
                 backend.name, idle)
        self.stops += 1
        self._active.pop(backend.name, None)
        self._begin(backend, supervisor.drain_and_stop(), "idle stop")

    async def _sleep(self, backend: Backend, level: int, idle: float) -> None:
        supervisor = self._supervisors.get(backend.name)
        if supervisor is None or not await supervisor.drained():
            backend.mark_ready()  # requests still running: not now
            return
        log.info("backend %s: idle for %.0f s; put to sleep (level %d)",
                 backend.name, idle, level)
        if await self.sleeper.sleep(backend, level):
            self.sleeps += 1
            backend.fall_asleep(level)
        else:
            log.warning("backend %s: vLLM did not go to sleep; it stays awake", backend.name)
            backend.mark_ready()
            self._active[backend.name] = self._clock()  # not tried again at once

    async def _wake(self, backend: Backend, model: str) -> None:
        level = backend.sleep_level or 1
        log.info("backend %s: woken for model %s (asleep at level %d)", backend.name, model,
                 level)
        backend.wake()
        await self._make_room(backend)
        if not await self.sleeper.wake(backend, level):
            return await self._cold(backend, "failed", "the wake failed")
        backend.verify()
        answer, known = await self.sleeper.answer(backend), self._answers.get(backend.name)
        if answer is None or (known is not None and known[0] == backend.pid
                              and answer != known[1]):
            return await self._cold(backend, "wrong_answer",
                                    "its answer after the wake differs from its first one")
        self.wakes += 1
        self._count("ok", backend)
        backend.mark_ready()

    async def _cold(self, backend: Backend, result: str, why: str) -> None:
        log.warning("backend %s: %s; restarted cold", backend.name, why)
        self.cold_restarts += 1
        self._count(result, backend)
        self._answers.pop(backend.name, None)
        supervisor = self._supervisors.get(backend.name)
        if supervisor is not None:
            await supervisor.restart()

    def _count(self, result: str, backend: Backend) -> None:
        self._checks[backend.name, result] += 1

    def counts(self) -> LifecycleCounts:
        """Every change of state, time spent per state, and wake check, for the metrics."""
        return {"transitions": [[*k, n] for k, n in sorted(self._moves.items())],
                "seconds": [[*k, *v] for k, v in sorted(self._spent.items())],
                "checks": [[*k, n] for k, n in sorted(self._checks.items())]}

    def _remember(self, backend: Backend) -> None:
        """Its answer to the check, the first time it is ready in this process's life."""
        spawn = backend.spec.spawn
        if (spawn is None or spawn.sleep_after is None or backend.state is not BackendState.READY
                or backend.name in self._busy):
            return
        known = self._answers.get(backend.name)
        if known is None or known[0] != backend.pid:
            self._begin(backend, self._record(backend), "check answer")

    async def _record(self, backend: Backend) -> None:
        pid, answer = backend.pid, await self.sleeper.answer(backend)
        if answer is not None and backend.pid == pid:
            self._answers[backend.name] = (pid, answer)

    async def sleep(self, backend: Backend) -> bool:
        """An operator's ``sleep NAME``: now, at its configured level (1 if none)."""
        spawn = backend.spec.spawn
        if backend.state is not BackendState.READY or backend.name in self._busy:
            return False
        level = spawn.sleep_level if spawn is not None else 1
        await self._sleep(backend, level, self._clock() - self._active.get(backend.name,
                                                                             self._clock()))
        return backend.state in (BackendState.ASLEEP,)  # (mypy keeps the narrowing above)

    async def wake(self, backend: Backend) -> bool:
        """An operator's ``wake NAME``."""
        if backend.state is not BackendState.ASLEEP or backend.name in self._busy:
            return False
        await self._wake(backend, "(an operator's wake)")
        return backend.state in (BackendState.READY,)

    def _changed(self, backend: Backend, old: BackendState, new: BackendState,
                 seconds: float) -> None:
        log.info("backend %s: %s -> %s (%.1f s %s)", backend.name, old.value, new.value,
                 seconds, old.value)
        self._moves[backend.name, old.value, new.value] += 1
        spent = self._spent.setdefault((backend.name, old.value), [0, 0.0])
        spent[0] += 1
        spent[1] += seconds

    async def run(self, every: float = 0.2) -> None:
        while True:
            try:
                self.look()
            except Exception:  # one bad look must not end demand for good
                log.exception("demand: a look failed")
            await asyncio.sleep(every)

    async def aclose(self) -> None:
        for task in list(self._busy.values()):
            task.cancel()
        await asyncio.gather(*self._busy.values(), return_exceptions=True)
        await self.sleeper.aclose()
