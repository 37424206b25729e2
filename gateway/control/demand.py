"""Spawned instances started, stopped, put to sleep and woken by demand (issue 39). The
control plane owns each instance's life for every serving process: they tell it the models
their requests wait for (``gateway.request.waking``) and how many attempts they sent each
backend, a few times a second.

- ``start = "on_demand"``: not started at boot (``Supervisor.waits_for_demand``) but at its
  model's first request.
- ``sleep_after``: idle that long, it is drained and put to sleep (``gateway.control.sleep``);
  a request for its model wakes it, and its answer to a temperature-0 check must equal the
  one the same process gave before its first sleep (drained: no batch to change greedy
  decoding), or it is restarted cold.
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

# Up or coming: its model starts no other. An unhealthy one is neither (requests wait).
UP = (BackendState.READY, BackendState.STARTING, BackendState.WAKING, BackendState.VERIFYING)
IDLE = (BackendState.READY, BackendState.ASLEEP)  # states whose idle time counts
COMING = ("wake", "start")  # jobs that bring an instance up
COMING_STATES = (BackendState.STARTING, BackendState.WAKING, BackendState.VERIFYING)


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
        self._answers: dict[str, tuple[int | None, str]] = {}  # (pid, its answer)
        self.starts = self.stops = self.sleeps = self.wakes = self.cold_restarts = 0

    def look(self) -> None:
        """Start or wake an instance for each model waited for; put to sleep or stop those
        idle too long."""
        for backend in self._pool.backends:
            if backend.transitions is None:
                backend.transitions = self._changed
        self._forget_removed()
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
            if backend.name in self._busy or self._neighbour_coming(backend):
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

    def _neighbour_coming(self, backend: Backend) -> bool:
        """Another instance on one of its GPUs (on any, with ``sequential_start``) is
        starting or waking: one at a time, so that each sees the memory the other took
        (vLLM's start-up check needs it too)."""
        gpus = set(backend.spec.spawn.gpus if backend.spec.spawn is not None else ())
        supervisor = self._supervisors.get(backend.name)
        in_turn = supervisor is not None and supervisor.sequential
        return (bool(gpus) or in_turn) and any(
            b is not backend and b.spec.spawn is not None
            and (in_turn or gpus & set(b.spec.spawn.gpus))
            and (b.state in COMING_STATES or self._doing.get(b.name) in COMING)
            for b in self._pool.backends)

    def _crowded(self, backend: Backend) -> list[Backend]:
        """Who must sleep or stop first for ``backend`` to fit on its GPUs (``room``):
        never one busy with a job, nor one whose model requests wait for."""
        wanted = self._wanted()
        return [b for b in to_make_room(self._pool.backends, backend,
                                        lambda b: self._active.get(b.name, 0.0))
                if b.name not in self._busy and not self._asked_for(b, wanted)]

    def _asked_for(self, backend: Backend, wanted: set[str] | None = None) -> bool:
        """Requests wait for one of ``backend``'s models (as clients name them)."""
        wanted = self._wanted() if wanted is None else wanted
        return any(backend in self._pool.demanded(model) for model in wanted)

    def _forget_removed(self) -> None:
        """What is kept per backend goes with a backend that a reload removed."""
        names = {b.name for b in self._pool.backends}
        if names.issuperset(self._active) and names.issuperset(self._answers):
            return
        for kept in (self._seen, self._active, self._answers):
            for name in set(kept) - names:
                del kept[name]

    async def _make_room(self, backend: Backend) -> None:
        jobs = []
        for other in self._crowded(backend):
            spawn, supervisor = other.spec.spawn, self._supervisors.get(other.name)
            if spawn is None or supervisor is None:
                continue
            log.info("backend %s: makes room on its GPUs for %s", other.name, backend.name)
            if spawn.sleep_after is not None:
                jobs.append(self._begin(other, self._sleep(other, spawn.sleep_level, 0.0),
                                        "sleep"))
            else:
                self.stops += 1
                jobs.append(self._begin(other, supervisor.drain_and_stop(), "idle stop"))
        await asyncio.gather(*(job for job in jobs if job is not None))

    async def _start_in_room(self, backend: Backend, supervisor: Supervisor) -> None:
        await self._make_room(backend)
        if supervisor.start():
            backend.start_over()
            self.starts += 1

    def _begin(self, backend: Backend, job: Coroutine[Any, Any, object],
               what: str) -> asyncio.Task[None] | None:
        """Run ``job`` for ``backend`` unless one runs for it already (then None)."""
        if backend.name in self._busy:
            job.close()
            return None
        task = asyncio.get_running_loop().create_task(self._guarded(backend, job, what),
                                                      name=f"{what} {backend.name}")
        self._busy[backend.name], self._doing[backend.name] = task, what
        task.add_done_callback(lambda _: self._done(backend.name))
        return task

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
        self._active.pop(backend.name, None)
        self._begin(backend, self._idle_stop(backend, supervisor), "idle stop")

    async def _idle_stop(self, backend: Backend, supervisor: Supervisor) -> None:
        awake = backend.state is BackendState.READY  # an asleep one is not called back
        drained = await supervisor.drained()
        if backend.state is not BackendState.DRAINING:
            return  # stopped or restarted meanwhile (an operator): theirs to say
        if awake and not drained:
            backend.mark_ready()  # requests still running: not now
            return
        if awake and self._called_off(backend):
            return
        self.stops += 1
        await supervisor.stop()

    def _called_off(self, backend: Backend) -> bool:
        """Drained for idleness, but a request for its model came meanwhile (it waits):
        back in rotation rather than stopped or put to sleep and then started again."""
        if not self._asked_for(backend):
            return False
        log.info("backend %s: asked for while it drained; it stays up", backend.name)
        backend.mark_ready()
        self._active[backend.name] = self._clock()
        return True

    async def _sleep(self, backend: Backend, level: int, idle: float) -> None:
        supervisor = self._supervisors.get(backend.name)
        if supervisor is None or not await supervisor.drained():
            if backend.state is BackendState.DRAINING:
                backend.mark_ready()  # requests still running: not now
            return
        if backend.state is not BackendState.DRAINING:
            return  # stopped or restarted meanwhile (an operator): theirs to say
        if idle and self._called_off(backend):
            return
        await self._remember(backend)
        log.info("backend %s: idle for %.0f s; put to sleep (level %d)",
                 backend.name, idle, level)
        slept = await self.sleeper.sleep(backend, level)
        if backend.state is not BackendState.DRAINING:
            return
        if slept or await self.sleeper.sleeping(backend):
            self.sleeps += 1
            backend.fall_asleep(level)
        elif await self.sleeper.sleeping(backend) is False:
            log.warning("backend %s: vLLM did not go to sleep; it stays awake", backend.name)
            backend.mark_ready()
            self._active[backend.name] = self._clock()  # not tried again at once
        else:  # asleep or not, vLLM does not say: start it again, cold
            await self._cold(backend, "failed", "vLLM does not say whether it sleeps")

    async def _remember(self, backend: Backend) -> None:
        """Its answer to the check, once per process: drained, so no batch changes what
        greedy decoding gives, and before its first sleep."""
        known = self._answers.get(backend.name)
        if known is not None and known[0] == backend.pid:
            return
        pid, answer = backend.pid, await self.sleeper.answer(backend)
        if answer is None:
            log.warning("backend %s: no answer to the check before its sleep; its wakes "
                        "go unchecked", backend.name)
        elif backend.pid == pid:
            self._answers[backend.name] = (pid, answer)

    async def _wake(self, backend: Backend, model: str) -> None:
        level = backend.sleep_level or 1
        log.info("backend %s: woken for model %s (asleep at level %d)", backend.name, model,
                 level)
        backend.wake()
        await self._make_room(backend)
        woke = backend.state is BackendState.WAKING and await self.sleeper.wake(backend, level)
        if backend.state is not BackendState.WAKING:
            return  # stopped or restarted meanwhile (an operator)
        if not woke:
            return await self._cold(backend, "failed", "the wake failed")
        backend.verify()
        known = self._answers.get(backend.name)
        if known is not None and known[0] == backend.pid:
            answer = await self.sleeper.answer(backend)
            if backend.state not in (BackendState.VERIFYING,):  # (mypy narrows too far)
                return
            if answer != known[1]:
                return await self._cold(backend, "wrong_answer", "its answer after the "
                                        "wake differs from the one before its first sleep")
        self.wakes += 1
        self._count("ok" if known is not None else "unchecked", backend)
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

    async def sleep(self, backend: Backend) -> bool:
        """An operator's ``sleep NAME``: now, at its configured level (1 if none)."""
        spawn = backend.spec.spawn
        if backend.state is not BackendState.READY:
            return False
        level = spawn.sleep_level if spawn is not None else 1
        return await self._by_hand(backend, self._sleep(backend, level, 0.0), "sleep",
                                   BackendState.ASLEEP)

    async def wake(self, backend: Backend) -> bool:
        """An operator's ``wake NAME``."""
        if backend.state is not BackendState.ASLEEP:
            return False
        return await self._by_hand(backend, self._wake(backend, "(an operator's wake)"),
                                   "wake", BackendState.READY)

    async def _by_hand(self, backend: Backend, job: Coroutine[Any, Any, object], what: str,
                       then: BackendState) -> bool:
        """Run an operator's job as any other (one per backend, guarded), to its end even
        if the operator's request goes away."""
        task = self._begin(backend, job, what)
        if task is None:
            return False
        await asyncio.shield(task)
        return backend.state is then

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
