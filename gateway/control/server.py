"""The control process's side of the control socket: its workers, their reports, the routes.

Each worker reports its in-flight requests and its view of every backend's state a few
times a second (``POST /control/sync``) and gets back the snapshot of what the control
process alone knows (``gateway.control.snapshot``): it probes, scrapes and supervises every
backend once for the replica, whatever the number of workers. A backend's in-flight count
here is the sum over the workers, plus one for each worker that has not yet seen the
backend leave rotation, so a drain (the same ``drain`` as in one process) waits for all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.backend import BackendState
from backends.supervisor import Supervisor
from gateway.control.snapshot import Snapshot
from gateway.metrics import LifecycleCounts
from gateway.routing.pool import BackendPool

log = logging.getLogger("gateway.control")

OUT_OF_ROTATION = frozenset({BackendState.DRAINING.value, BackendState.STOPPED.value})
Report = dict[str, tuple[int, str]]  # backend name -> (in flight, state as the worker sees it)


# A worker reports every 0.2 s: one silent this long is hung (stopped, or its loop blocked),
# and one that has not reported this long after its start never came up.
SILENT = 5.0
FIRST_REPORT = 60.0
RECENT = 20  # degraded replies kept for the status page, as each worker keeps


class WorkerTable:
    """The serving workers as the control process knows them: pids and their last reports."""

    def __init__(self, pool: BackendPool, supervisors: Mapping[str, Supervisor],
                 clock: Callable[[], float] = time.monotonic,
                 discovered: Callable[[], dict[str, list[str]]] = dict) -> None:
        self._pool = pool
        self.snapshot = Snapshot(pool, supervisors, discovered)
        self._clock = clock
        self._reports: dict[int, tuple[float, Report]] = {}
        self._pins: dict[int, dict[str, int]] = {}  # sessions each worker pinned, per backend
        self._born: dict[int, float] = {}
        self.pids: set[int] = set()
        self.replaced = {"hung": 0, "exited": 0}  # workers replaced, by why
        # The control plane's counts of backends' changes of state (``Demand.counts``).
        self.lifecycle: Callable[[], LifecycleCounts] = dict
        self._config: tuple[int, str] | None = None  # the last reload's: (version, text)
        self._kept: str | None = None  # where new workers read that text
        self._degraded: list[dict[str, Any]] = []  # every worker's recent ones, newest first
        self._uses: dict[int, dict[str, int]] = {}  # attempts each worker sent each backend
        self._wanted: dict[int, list[str]] = {}  # models each worker's requests wait for

    def add(self, pid: int) -> None:
        self.pids.add(pid)
        self._born[pid] = self._clock()

    def forget(self, pid: int) -> None:
        """A worker ended: its requests ended with it."""
        self.pids.discard(pid)
        self._reports.pop(pid, None)
        self._pins.pop(pid, None)
        self._born.pop(pid, None)
        self._uses.pop(pid, None)
        self._wanted.pop(pid, None)
        self._count()

    def silent(self) -> dict[int, float]:
        """The workers that stopped reporting (or never began), with the seconds since they
        were last heard of."""
        now, out = self._clock(), {}
        for pid in self.pids:
            report = self._reports.get(pid)
            heard = report[0] if report is not None else self._born.get(pid, now)
            if now - heard > (SILENT if report is not None else FIRST_REPORT):
                out[pid] = now - heard
        return out

    def excuse(self) -> None:
        """This process could not listen for a while (it was stopped, or its loop blocked):
        nobody is silent for that."""
        now = self._clock()
        self._reports = {pid: (now, r) for pid, (_, r) in self._reports.items()}
        self._born = dict.fromkeys(self._born, now)

    def publish(self, version: int, text: str | None) -> None:
        """The config this process accepted (its ``version``-th reload, as it read the file;
        0: at start): each worker takes it at its next report, without reading the file
        itself, and a worker started later reads it from ``keep``'s file."""
        if text is not None:
            self._config = (version, text)
            if self._kept is not None:
                _write(self._kept, text)

    def keep(self, path: str) -> None:
        """Keep the config text this process runs in ``path`` (its private dir) from now
        on, for the workers it starts."""
        self._kept = path
        if self._config is not None:
            _write(path, self._config[1])

    def report(self, pid: int, report: Report, pins: Mapping[str, int] | None = None,
               degraded: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """A worker's in-flight counts (the sessions it pinned, the degraded replies it
        gave since its last report); the snapshot it adopts in return."""
        if pid in self.pids:
            self._reports[pid] = (self._clock(), report)
            self._pins[pid] = dict(pins or {})
            if degraded:
                merged = sorted([*self._degraded, *degraded], key=lambda e: -float(e["at"]))
                self._degraded = merged[:RECENT]
            self._count()
        return self.snapshot()

    def replica(self) -> dict[str, Any]:
        """What only the whole replica tells, for every worker's status views: each
        backend's requests in flight and the sessions pinned to it (summed over the
        workers), and the recent degraded replies of every worker, newest first."""
        pins: dict[str, int] = {}
        for made in self._pins.values():
            for name, n in made.items():
                pins[name] = pins.get(name, 0) + n
        in_flight: dict[str, int] = {}
        for _, report in self._reports.values():
            for name, (n, _state) in report.items():
                in_flight[name] = in_flight.get(name, 0) + n
        return {"in_flight": {b.name: in_flight.get(b.name, 0) for b in self._pool.backends},
                "pins": pins, "degraded": self._degraded}

    def uses(self) -> dict[str, int]:
        """Attempts sent to each backend, summed over the live workers (a worker's end
        makes the sum go back: a change, as a use is)."""
        out: dict[str, int] = {}
        for made in self._uses.values():
            for name, n in made.items():
                out[name] = out.get(name, 0) + n
        return out

    def wanted(self) -> set[str]:
        """The models some worker's requests wait for."""
        return {m for models in self._wanted.values() for m in models}

    async def settle(self, within: float = 2.0, poll: float = 0.02) -> None:
        """Wait until every worker has reported since now (so it has seen what changed)."""
        start = self._clock()
        deadline = start + within
        while self._clock() < deadline and any(  # noqa: ASYNC110 (reports, not an event)
                self._reports.get(pid, (start, {}))[0] <= start for pid in self.pids):
            await asyncio.sleep(poll)
        self._count()

    def _count(self) -> None:
        for backend in self._pool.backends:
            leaving = backend.state.value in OUT_OF_ROTATION
            total = 0
            for pid in self.pids:
                count, state = self._reports.get(pid, (0.0, {}))[1].get(backend.name, (0, ""))
                total += count + (leaving and state not in OUT_OF_ROTATION)
            backend.in_flight = total

    def routes(self) -> list[Route]:
        return [Route("/control/sync", self._sync, methods=["POST"])]

    async def _sync(self, request: Request) -> Response:
        data = orjson.loads(await request.body())
        report = {name: (int(v[0]), str(v[1])) for name, v in data["backends"].items()}
        pins = {str(name): int(n) for name, n in data.get("pins", {}).items()}
        pid = int(data["pid"])
        snapshot = self.report(pid, report, pins, data.get("degraded", ()))
        if pid in self.pids:
            self._uses[pid] = {name: int(v[2]) for name, v in data["backends"].items()
                               if len(v) > 2}
            self._wanted[pid] = [str(m) for m in data.get("wanted", ())]
        answer = {"snapshot": snapshot, "replica": self.replica(), "replaced": self.replaced,
                  "lifecycle": self.lifecycle()}
        if self._config is not None and int(data.get("config", 0)) < self._config[0]:
            answer["config"] = {"version": self._config[0], "text": self._config[1]}
        return Response(orjson.dumps(answer), media_type="application/json")

    def __repr__(self) -> str:
        return f"<WorkerTable [{len(self.pids)} | reported {len(self._reports)}]>"


def _write(path: str, text: str) -> None:
    """Replace the file at ``path`` with ``text`` whole (a reader sees the old or the new;
    a config is a few KiB, written at start and at each reload)."""
    part = path + ".part"
    try:
        with open(part, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(part, path)
    except OSError as exc:  # the reload stands
        log.error("cannot keep the config for new workers in %s: %s (a new worker reads "
                  "the last one kept, then its first sync brings this one)", path, exc)
