"""Starts one spawned backend, waits until it is ready, restarts it when it crashes.

Crash restarts back off exponentially with jitter; ``crash_loop_restarts`` crashes within
``crash_loop_window`` seconds mark the backend failed until an operator restarts it.

No process of a backend outlives its wrapper: after every life, whatever is left of the
recorded process group is killed (the wrapper may have been SIGKILLed). Before every
start the port is checked: an orphan of this backend holding it is killed; any other
holder marks the backend failed at once, with the reason in ``problem`` and the log.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from backends import family
from backends.backend import Backend, BackendState
from backends.health import Probe
from backends.launcher import Launch, build

log = logging.getLogger("backends.supervisor")


class SupervisorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backoff_initial: float = Field(default=1.0, gt=0)
    backoff_max: float = Field(default=60.0, gt=0)
    crash_loop_restarts: int = Field(default=5, ge=1)
    crash_loop_window: float = Field(default=300.0, gt=0)
    stop_grace: float = Field(default=20.0, gt=0, description="SIGTERM to SIGKILL, seconds")
    startup_probe_interval: float = Field(default=0.5, gt=0)
    log_dir: str = "logs"
    log_max_bytes: int = Field(default=10 * 1024 * 1024, ge=1024)
    log_backups: int = Field(default=3, ge=0)
    drain_timeout: float = Field(default=60.0, gt=0, description="wait for in-flight requests")
    policy_interval: float = Field(default=5.0, gt=0, description="max_uptime/max_rss checks")
    # Start spawned backends one after another, each once the previous is ready (several
    # vLLM instances on one GPU: each one's start-up memory check must see the others).
    sequential_start: bool = False


PLANNED = "planned restart"


async def start_in_turn(supervisors: list[Supervisor], poll: float = 0.5) -> None:
    """Start each supervisor once the previous backend is ready (or has given up)."""
    settled = (BackendState.READY, BackendState.FAILED, BackendState.STOPPED)
    for supervisor in supervisors:
        supervisor.start()
        backend = supervisor.backend
        while backend.state not in settled:  # noqa: ASYNC110 (a state, not an event)
            await asyncio.sleep(poll)
        log.info("backend %s: %s; starting the next one", backend.name, backend.state.value)


Settle = Callable[[], Awaitable[None]]


async def drain(backend: Backend, within: float, poll: float = 0.05,
                settle: Settle | None = None) -> bool:
    """Take a backend out of rotation and wait for its in-flight requests to finish.

    ``settle`` waits until whoever else counts its requests (other processes) has seen it
    leave rotation, so that ``in_flight`` counts all of them."""
    backend.drain()
    if settle is not None:
        await settle()
    deadline = time.monotonic() + within
    # in_flight is a bare counter on the hot path; polling it during a drain costs nothing.
    while backend.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(poll)
    return backend.in_flight == 0


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants, MiB (Linux /proc)."""
    total_kb = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return total_kb / 1024


class Supervisor:
    def __init__(
        self,
        backend: Backend,
        settings: SupervisorSettings,
        probe: Probe,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        settle: Settle | None = None,
    ) -> None:
        assert backend.spec.spawn is not None
        self.backend = backend
        self._spawn = backend.spec.spawn
        self._settings = settings
        self._probe = probe
        self._clock = clock
        self._jitter = jitter
        self._settle = settle  # see drain()
        self._crashes: deque[float] = deque()
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.problem: str | None = None  # why the backend was not started, if it wasn't

    @property
    def log_path(self) -> Path:
        return Path(self._settings.log_dir) / f"{self.backend.name}.log"

    @property
    def record_path(self) -> Path:
        """Where the wrapper writes its command's process group (see backends.family)."""
        return Path(self._settings.log_dir) / f"{self.backend.name}.family"

    def start(self) -> bool:
        """Start (or, after failed/stopped, restart) the run loop; False when it runs."""
        if self._task is not None and not self._task.done():
            return False
        self._stopping = False
        self._crashes.clear()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"supervise {self.backend.name}")
        return True

    @property
    def sequential(self) -> bool:
        """Instances start one after another (``supervisor.sequential_start``)."""
        return self._settings.sequential_start

    def waits_for_demand(self) -> bool:
        """True for an instance with ``start = "on_demand"``, marked stopped instead of
        started (at boot or when a reload adds it): its model's first request starts it."""
        if self._spawn.start == "on_demand":
            self.backend.stop()
            return True
        return False

    async def stop(self) -> None:
        await self._halt()
        self.backend.stop()

    async def restart(self) -> None:
        """An operator's restart: stop, forget the crash history, start again."""
        await self._halt()
        self.backend.start_over()
        self.start()

    async def _halt(self) -> None:
        self._stopping = True
        await self._terminate()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def backoff(self, crashes: int) -> float:
        base = min(self._settings.backoff_max,
                   self._settings.backoff_initial * 2.0 ** max(crashes - 1, 0))
        return base * (0.5 + self._jitter() / 2)  # "equal jitter": half fixed, half random

    async def drain_and_restart(self) -> bool:
        """Drain, then restart; True when every in-flight request finished first."""
        drained = await self.drained()
        await self.restart()
        return drained

    async def drained(self) -> bool:
        """Out of rotation, and its requests (every worker's) ended within drain_timeout."""
        return await drain(self.backend, self._settings.drain_timeout, settle=self._settle)

    async def drain_and_stop(self) -> bool:
        """Drain, then stop for good (the backend left the config)."""
        drained = await self.drained()
        await self.stop()
        return drained

    async def _run(self) -> None:
        while not self._stopping:
            self.problem = await asyncio.to_thread(self.clear_the_way)
            if self.problem is not None:
                self.backend.fail()
                log.error("backend %s: %s", self.backend.name, self.problem)
                return
            if self._stopping:
                return
            code = await self._one_life()
            await asyncio.to_thread(self.sweep)
            if self._stopping:
                return
            if code == PLANNED:
                continue
            now = self._clock()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > self._settings.crash_loop_window:
                self._crashes.popleft()
            self.backend.restarts += 1
            if len(self._crashes) >= self._settings.crash_loop_restarts:
                self.backend.fail()
                log.error("backend %s: %d crashes within %g s: marked failed, not restarting "
                          "until an operator does", self.backend.name, len(self._crashes),
                          self._settings.crash_loop_window)
                return
            delay = self.backoff(len(self._crashes))
            log.warning("backend %s exited (%s): restart %d in %.1f s", self.backend.name, code,
                        self.backend.restarts, delay)
            await asyncio.sleep(delay)

    async def _one_life(self) -> int | str:
        """Run the process once: until it exits, or fails to become ready in time."""
        backend = self.backend
        backend.start_over()
        # build() may look through site-packages and rss_mb() walks /proc: keep file
        # reads off the event loop.
        launch = await asyncio.to_thread(functools.partial(
            build, self._spawn, backend=backend.name))
        self._proc = await self._exec(launch)
        backend.pid = self._proc.pid
        backend.started_at = self._clock()
        log.info("backend %s: started pid %d: %s", backend.name, self._proc.pid,
                 " ".join(launch.argv))
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            if not await self._wait_ready(exited):
                if exited.done():
                    return exited.result()
                log.error("backend %s: not ready within %g s", backend.name,
                          self._spawn.startup_timeout)
                await self._terminate()
                return "start-up timeout"
            backend.mark_ready()
            log.info("backend %s: ready after %.1f s", backend.name,
                     self._clock() - backend.started_at)
            return await self._serve_until_exit(exited)
        finally:
            exited.cancel()
            backend.pid = None
            backend.started_at = None
            backend.mark_lost()

    async def _serve_until_exit(self, exited: asyncio.Future[int]) -> int | str:
        """Wait for the process to exit; restart it on purpose when a policy says so."""
        spawn = self._spawn
        if spawn.max_uptime is None and spawn.max_rss_mb is None:
            return await exited
        while True:
            await asyncio.wait({exited}, timeout=self._settings.policy_interval)
            if exited.done():
                return exited.result()
            reason = await asyncio.to_thread(self._policy_reason)
            if reason is not None:
                log.warning("backend %s: %s: draining and restarting", self.backend.name, reason)
                await drain(self.backend, self._settings.drain_timeout)
                await self._terminate()
                return PLANNED

    def _policy_reason(self) -> str | None:
        b, spawn = self.backend, self._spawn
        if b.state is not BackendState.READY:
            return None  # not now: asleep (its weights in host memory), waking, draining...
        if spawn.max_uptime is not None and b.started_at is not None:
            if self._clock() - b.started_at > spawn.max_uptime:
                return f"up longer than max_uptime {spawn.max_uptime:g} s"
        if spawn.max_rss_mb is not None and self._proc is not None:
            rss = rss_mb(self._proc.pid)
            if rss > spawn.max_rss_mb:
                return f"RSS {rss:.0f} MiB above max_rss_mb {spawn.max_rss_mb}"
        return None

    async def _exec(self, launch: Launch) -> asyncio.subprocess.Process:
        s = self._settings
        argv = [sys.executable, "-m", "backends.reaper", "--log", str(self.log_path),
                "--max-bytes", str(s.log_max_bytes), "--backups", str(s.log_backups),
                "--grace", str(s.stop_grace), "--parent", str(os.getpid()),
                "--record", str(self.record_path), "--", *launch.argv]
        return await asyncio.create_subprocess_exec(
            *argv, env=launch.env, stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True, cwd=os.getcwd())

    async def _wait_ready(self, exited: asyncio.Future[int]) -> bool:
        deadline = self._clock() + self._spawn.startup_timeout
        while self._clock() < deadline and not exited.done():
            result = await self._probe(self.backend)
            self.backend.last_probe = "ok" if result.ok else "failed (starting)"
            if result.ok and result.models:
                self.backend.learn(result.models, result.cards)
                return True
            await asyncio.wait({exited}, timeout=self._settings.startup_probe_interval)
        return False

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()  # the reaper stops the whole process group
        try:
            await asyncio.wait_for(proc.wait(), self._settings.stop_grace + 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def sweep(self) -> None:
        """Kill what is left of the recorded family: its wrapper may have died by SIGKILL."""
        record = family.Record.load(self.record_path)
        if record is None:
            return
        hit = family.kill(lambda: family.members(record), self._settings.stop_grace)
        if hit:
            log.warning("backend %s: its wrapper is gone, %d processes of its group %d were "
                        "not: killed %s", self.backend.name, len(hit), record.pgid,
                        ", ".join(map(str, hit)))
        self.record_path.unlink(missing_ok=True)

    def clear_the_way(self) -> str | None:
        """Make sure no orphan holds our port; return why we must not start, if so."""
        self.sweep()
        spawn, name = self._spawn, self.backend.name
        holders = family.port_holders(spawn.port)
        foreign = [p for p in holders
                   if family.marker(p) != name or family.supervised_by(p) is not None]
        if foreign:
            return (f"port {spawn.port} is held by {family.describe(foreign[0])}, which is "
                    "not an orphan of this backend: not starting it (free the port, then "
                    "restart the backend)")
        # Never our own group (someone ran it by hand, marked, from the gateway's shell).
        groups = {s.pgid for s in map(family.stat, holders) if s is not None} - {os.getpgrp()}
        if holders:
            log.warning("backend %s: port %d is held by an orphan of this backend, %s: "
                        "killing it and its process group", name, spawn.port,
                        ", ".join(map(family.describe, holders)))
            family.kill(lambda: {*filter(family.alive, holders),
                                 *(p for g in groups for p in family.group(g))},
                        self._settings.stop_grace)
        if not family.wait_port_free(spawn.host, spawn.port, self._settings.stop_grace):
            return (f"port {spawn.port} is in use by a process this gateway cannot see: "
                    "not starting the backend (free the port, then restart it)")
        return None

    def __repr__(self) -> str:
        b = self.backend
        problem = f" | {self.problem}" if self.problem else ""
        return (f"<Supervisor {b.name} [{b.state.value} | pid {b.pid} | "
                f"restarts {b.restarts}{problem}]>")
