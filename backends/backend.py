"""Runtime state of one backend, shared by the health checker and the request path."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.spec import BackendSpec


class BackendState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"
    # Sleep mode (issue 39): vLLM's engine asleep, being woken, its answers being checked.
    ASLEEP = "asleep"
    WAKING = "waking"
    VERIFYING = "verifying"


# States the health probes leave alone: their owner (an operator, the supervisor, demand)
# moves the backend out of them.
STEADY = frozenset({BackendState.DRAINING, BackendState.STOPPED, BackendState.FAILED,
                    BackendState.ASLEEP, BackendState.WAKING, BackendState.VERIFYING})

# Told of every change of state (the control plane logs and counts them): the backend,
# the state it left, the one it entered, and the seconds it spent in the one it left.
Transitions = Callable[["Backend", BackendState, BackendState, float], None]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a vLLM backend says about itself on /metrics (scraped) and its GPUs (NVML)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None  # 0-1
    prefix_hit_ratio: float | None = None  # since the previous scrape
    gpus: tuple[GpuReading, ...] = ()
    # vllm:lora_requests_info (an instance with LoRA on): the adapters of the requests
    # running, and how many adapters one batch may hold (--max-loras).
    loras_running: tuple[str, ...] = ()
    max_loras: int | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    memory_used: int  # bytes
    memory_total: int
    temperature: int  # Celsius


@dataclass(frozen=True, slots=True)
class Life:
    """What the control plane alone knows of a backend, as a serving worker adopts it."""

    state: BackendState
    pid: int | None
    started_at: float | None
    restarts: int
    models: frozenset[str]
    cards: dict[str, dict[str, Any]]
    load: LoadReport | None
    last_probe: str
    flaps: int
    sleep_level: int | None = None  # while asleep


class Backend:
    """A backend as the gateway sees it right now.

    Mutated only from the event loop: no locks needed.
    """

    __slots__ = ("_since", "_state", "_streak", "busy_until", "capacity", "cards", "flaps",
                 "in_flight", "last_probe", "load", "models", "pid", "restarts", "sleep_level",
                 "spec", "started_at", "transitions", "url", "uses")

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.url = spec.base_url
        self._state = BackendState.STARTING
        self._since = time.monotonic()  # when it entered its state
        self.transitions: Transitions | None = None
        self.sleep_level: int | None = None  # while asleep
        self.in_flight = 0
        self.uses = 0  # attempts sent here by this process, ever (its idle time is told by it)
        self.capacity = spec.capacity  # requests at once; 0: no limit
        self.models: frozenset[str] = frozenset()
        self.cards: dict[str, dict[str, Any]] = {}  # each model's entry in vLLM's /v1/models
        self.flaps = 0
        self.restarts = 0
        self.pid: int | None = None
        self.started_at: float | None = None  # monotonic, while a spawned process runs
        self.last_probe: str = "none yet"
        # A 429/503 with Retry-After means busy, not dead: skipped until then (monotonic).
        self.busy_until = 0.0
        self.load: LoadReport | None = None  # the latest scrape, when enabled
        self._streak = 0  # consecutive probes disagreeing with the current state

    @property
    def state(self) -> BackendState:
        """Changed only through the methods below and ``observe_probe``."""
        return self._state

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def managed(self) -> bool:
        """Spawned and supervised by the gateway (its start-up is the supervisor's call)."""
        return self.spec.spawn is not None

    @property
    def on_demand(self) -> bool:
        """Spawned with ``start = "on_demand"``: started by its model's first request."""
        return self.spec.spawn is not None and self.spec.spawn.on_demand

    @property
    def routable(self) -> bool:
        return self._state is BackendState.READY and (
            not self.busy_until or time.monotonic() >= self.busy_until)

    @property
    def queue(self) -> float:
        """Requests on this backend: ours in flight, or all its clients' as vLLM last
        reported them (running + waiting), whichever is more."""
        load = self.load
        if load is None:
            return self.in_flight
        return max(self.in_flight, load.running + load.waiting)

    def serves(self, model: str) -> bool:
        return model in self.models

    # Every change of state goes through one of these (or observe_probe).

    def _become(self, state: BackendState) -> None:
        old, now = self._state, time.monotonic()
        if state is old:
            return
        self._state, since, self._since = state, self._since, now
        if state is not BackendState.ASLEEP:
            self.sleep_level = None
        if self.transitions is not None:
            self.transitions(self, old, state, now - since)

    def fall_asleep(self, level: int) -> None:
        """vLLM said it sleeps (``/sleep?level=``): out of rotation until woken."""
        self._become(BackendState.ASLEEP)
        self.sleep_level = level

    def wake(self) -> None:
        """Being woken (``/wake_up``)."""
        self._become(BackendState.WAKING)

    def verify(self) -> None:
        """Awake again; its answers are checked before it takes traffic."""
        self._become(BackendState.VERIFYING)

    def mark_busy(self, seconds: float) -> None:
        """Busy, not broken (a 429 or 503 with Retry-After): skipped for ``seconds``."""
        self.busy_until = time.monotonic() + seconds

    def start_over(self) -> None:
        """Starting (again): its probes, or its supervisor, say when it is ready."""
        self._become(BackendState.STARTING)
        self._streak = 0

    def mark_ready(self) -> None:
        """Its supervisor saw the process ready."""
        self._become(BackendState.READY)

    def mark_lost(self) -> None:
        """Its process ended: out of rotation, unless it had already left it."""
        if self._state is BackendState.READY:
            self._become(BackendState.UNHEALTHY)

    def drain(self) -> None:
        """Out of rotation; the requests it has go on until they end."""
        self._become(BackendState.DRAINING)

    def stop(self) -> None:
        self._become(BackendState.STOPPED)

    def fail(self) -> None:
        """Given up on until an operator starts it again."""
        self._become(BackendState.FAILED)

    def life(self) -> Life:
        return Life(self._state, self.pid, self.started_at, self.restarts, self.models,
                    self.cards, self.load, self.last_probe, self.flaps, self.sleep_level)

    def adopt(self, life: Life) -> None:
        """Its life as its owner sees it, whole (a serving worker's copy of a backend the
        control plane probes, scrapes and supervises)."""
        self._state, self._streak = life.state, 0
        self.pid, self.started_at, self.restarts = life.pid, life.started_at, life.restarts
        self.models, self.cards, self.load = life.models, life.cards, life.load
        self.last_probe, self.flaps = life.last_probe, life.flaps
        self.sleep_level = life.sleep_level

    def learn(self, models: frozenset[str], cards: dict[str, dict[str, Any]] | None) -> None:
        """What it serves, and vLLM's card of each model (``max_model_len``, ``root``...)."""
        self.models = models
        if cards is not None:
            self.cards = cards

    def observe_probe(self, ok: bool, fall: int, rise: int) -> bool:
        """Apply one health-probe result; return True when the state changed.

        A backend flips only after ``fall`` failures (or ``rise`` successes) in a row,
        so one lost probe never takes it out of rotation.
        """
        if self._state in STEADY:
            return False
        if self._state is BackendState.STARTING:
            # A fresh backend has no earlier state to protect: its first probe decides,
            # except for a spawned one, whose supervisor decides when it is ready (what
            # answers on its port before that may be an orphan the supervisor will kill).
            if self.managed:
                return False
            self._streak = 0
            self._become(BackendState.READY if ok else BackendState.UNHEALTHY)
            return True
        if ok == (self._state is BackendState.READY):
            self._streak = 0
            return False
        self._streak += 1
        if self._streak < (rise if ok else fall):
            return False
        self._streak = 0
        self.flaps += 1
        self._become(BackendState.READY if ok else BackendState.UNHEALTHY)
        return True

    def __repr__(self) -> str:
        return (
            f"<Backend {self.name} [{self._state.value} | in-flight {self.in_flight} | "
            f"models {len(self.models)} | flaps {self.flaps}]>"
        )
