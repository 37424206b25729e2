"""The chaos driver: one fault at a time, at random intervals, each class in a seeded random
order (every class comes round once before any comes twice), each bounded and undone before
the next. It runs in a thread of its own (it waits on processes), beside the clients' loop,
and logs what it did and when (monotonic seconds, the clients' clock)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from bench.chaos.stack import Proc, Stack

KINDS = ("kill_backend", "stall_backend", "error_backend", "inband_backend", "kill_redis",
         "kill_gateway", "reload")
SIM_FAULTS = {"stall_backend": "fault=stall,after=2,stall=30", "error_backend": "fault=500",
              "inband_backend": "fault=inband,after=3"}


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    at: float
    replica: str
    started: float  # when that replica last started
    rss_mb: float
    fds: int


class Driver(threading.Thread):
    def __init__(self, stack: Stack, seed: int, until: float, gap: tuple[float, float],
                 hold: tuple[float, float], spare_from: float) -> None:
        super().__init__(daemon=True, name="chaos-driver")
        self.stack, self.until, self.gap, self.hold = stack, until, gap, hold
        # From then on the first replica is not killed: its memory and descriptors are
        # measured over that stretch (the second one still is).
        self.spare_from = spare_from
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            order: list[str] = []
            while self._pause(self.rng.uniform(*self.gap)):
                if not order:
                    order = self.rng.sample(KINDS, len(KINDS))
                kind = order.pop()
                action: Callable[[Fault], None] = getattr(self, "_" + kind)
                fault = Fault(kind, "", time.monotonic())
                action(fault)
                fault.end = time.monotonic()
                self.faults.append(fault)
        except BaseException as exc:
            self.error = exc

    def _pause(self, seconds: float) -> bool:
        """Sample the replicas while waiting; False once the soak's time is up."""
        end = min(time.monotonic() + seconds, self.until)
        while time.monotonic() < end:
            self.sample()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        return time.monotonic() < self.until

    def sample(self) -> None:
        now = time.monotonic()
        for proc in self.stack.gateways:
            rss, fds = proc.footprint()
            if rss:
                self.samples.append(Sample(now, proc.name, proc.started, rss, fds))

    def _held(self) -> float:
        return self.rng.uniform(*self.hold)

    def _kill_backend(self, fault: Fault) -> None:
        name = fault.target = self.rng.choice(sorted(self.stack.sims))
        self._restart(self.stack.sims[name], fault)

    def _kill_gateway(self, fault: Fault) -> None:
        spared = time.monotonic() >= self.spare_from
        proc = self.rng.choice(self.stack.gateways[1:] if spared else self.stack.gateways)
        fault.target = proc.name
        before = self._state()
        self._restart(proc, fault)
        fault.detail["kept"] = _kept(before, self._state())

    def _kill_redis(self, fault: Fault) -> None:
        fault.target = "valkey"
        before = self._state()
        self._restart(self.stack.valkey, fault)
        fault.detail["kept"] = _kept(before, self._state())

    def _restart(self, proc: Proc, fault: Fault) -> None:
        proc.kill()
        down = self._held() / 2
        fault.detail["down_s"] = round(down, 2)
        time.sleep(down)  # the fault's length: the process is gone this long
        proc.start()
        proc.wait_ready(120)

    def _stall_backend(self, fault: Fault) -> None:
        self._sim_fault(fault)

    def _error_backend(self, fault: Fault) -> None:
        self._sim_fault(fault)

    def _inband_backend(self, fault: Fault) -> None:
        self._sim_fault(fault)

    def _sim_fault(self, fault: Fault) -> None:
        name = fault.target = self.rng.choice(sorted(self.stack.sims))
        url = self.stack.sims[name].ready.rsplit("/", 1)[0] + "/sim/fault"
        httpx.post(url, json={"set": SIM_FAULTS[fault.kind]}, timeout=5).raise_for_status()
        time.sleep(self._held())  # the fault's length
        httpx.post(url, json={"set": ""}, timeout=5).raise_for_status()

    def _reload(self, fault: Fault) -> None:
        proc = self.rng.choice(self.stack.gateways)
        fault.target = proc.name
        proc.signal(signal.SIGHUP)

    def _state(self) -> dict[str, str]:
        """Every session pin and canary arm in the valkey (empty while it is down)."""
        try:
            client = redis.Redis.from_url(self.stack.redis_url, decode_responses=True,
                                          socket_timeout=2)
            keys = [k for pattern in ("vgw:pin:*", "vgw:arm:*")
                    for k in client.scan_iter(pattern, count=1000)]
            values = client.mget(keys) if keys else []
            return {k: v for k, v in zip(keys, values, strict=True) if v is not None}
        except redis.RedisError:
            return {}


def _kept(before: dict[str, str], after: dict[str, str]) -> dict[str, int]:
    """Pins and arms present before the restart, and how many were still there, the same."""
    return {"before": len(before),
            "kept": sum(1 for k, v in before.items() if after.get(k) == v)}
