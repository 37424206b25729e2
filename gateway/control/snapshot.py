"""The control plane's snapshot: every backend's life (state, process, models, load, probe
results) and each discover entry's addresses, versioned. The control process alone probes,
scrapes, resolves and supervises; each serving worker adopts a new version whole, with no
rules about which fields win.

The version changes only when some backend's life changed, so a worker adopts nothing
between changes, except a backend object new to it (a reload in the worker made it anew).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from backends.backend import Backend, BackendState, GpuReading, Life, LoadReport
from backends.supervisor import Supervisor
from gateway.routing.pool import BackendPool


def encode(backend: Backend, problem: str | None) -> dict[str, Any]:
    life = backend.life()
    return {"state": life.state.value, "pid": life.pid, "started_at": life.started_at,
            "restarts": life.restarts, "models": sorted(life.models), "cards": life.cards,
            "load": asdict(life.load) if life.load is not None else None,
            "last_probe": life.last_probe, "flaps": life.flaps, "problem": problem,
            "sleep_level": life.sleep_level}


def decode(data: Mapping[str, Any]) -> Life:
    load = data.get("load")
    return Life(
        BackendState(data["state"]), data.get("pid"), data.get("started_at"),
        int(data.get("restarts", 0)), frozenset(data.get("models") or ()),
        dict(data.get("cards") or {}),
        None if load is None else LoadReport(**{
            **load, "gpus": tuple(GpuReading(**g) for g in load.get("gpus", ())),
            "loras_running": tuple(load.get("loras_running", ()))}),
        str(data.get("last_probe", "none yet")), int(data.get("flaps", 0)),
        data.get("sleep_level"))


class Snapshot:
    """The control process's side: what it publishes, with a version that changes with it."""

    def __init__(self, pool: BackendPool, supervisors: Mapping[str, Supervisor],
                 discovered: Callable[[], dict[str, list[str]]] = dict) -> None:
        self._pool = pool
        self._supervisors = supervisors  # the reloadable's own dict: a reload changes it
        self._discovered = discovered  # each discover entry's addresses, as last found
        self._last: dict[str, Any] = {}
        self.version = 0

    def __call__(self) -> dict[str, Any]:
        lives = {}
        for b in self._pool.backends:
            supervisor = self._supervisors.get(b.name)
            lives[b.name] = encode(b, supervisor.problem if supervisor is not None else None)
        now = {"backends": lives, "discovered": self._discovered()}
        if now != self._last:
            self._last, self.version = now, self.version + 1
        return {"version": self.version, **now}


class Adopter:
    """A serving worker's side: its backends take each new version whole."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool
        self._version = 0
        self._seen: dict[str, Backend] = {}
        self.problems: dict[str, str | None] = {}
        self.discovered: dict[str, list[str]] = {}  # the control process's DNS answers
        self.rediscover = asyncio.Event()  # set when they changed: the worker applies them

    def __call__(self, snapshot: Mapping[str, Any]) -> None:
        version, lives = snapshot["version"], snapshot["backends"]
        discovered = snapshot.get("discovered", {})
        if discovered != self.discovered:
            self.discovered = discovered
            self.rediscover.set()
        for backend in self._pool.backends:
            data = lives.get(backend.name)
            if data is None or (version == self._version
                                and self._seen.get(backend.name) is backend):
                continue
            backend.adopt(decode(data))
            self._seen[backend.name] = backend
            self.problems[backend.name] = data.get("problem")
        self._version = version
