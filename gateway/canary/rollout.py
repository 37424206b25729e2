"""The canary rollout: weights between a stable and a canary group, per-arm statistics of
the current step, and the decisions (step up, promote, roll back) taken from them.

No I/O here. ``CanarySync`` shares the state and the statistics through Redis and runs
the analysis on one gateway process at a time; without Redis each process decides alone
from what it saw.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gateway.config import CanarySection, RolloutSection
from gateway.metrics import Metrics

log = logging.getLogger("gateway.canary")

# Upper bounds (seconds) of the TTFT buckets kept per arm; p95 is read off them.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                5.0, 10.0, 30.0, 60.0, float("inf"))


class Phase(enum.StrEnum):
    MANUAL = "manual"  # the weight is set by hand (config or operator)
    ROLLING = "rolling"  # the analysis steps it up
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


class Verdict(enum.StrEnum):
    """What one step's windows say (a metric label too)."""

    ADVANCE = "advance"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True)
class CanaryState:
    """What every gateway process must agree on; shared as JSON with a version."""

    weight: float = 0.0  # canary percentage
    step: int = -1  # index into the rollout steps; -1 when set by hand
    paused: bool = False
    phase: Phase = Phase.MANUAL
    version: int = 0
    by: str = "config"
    why: str = ""
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CanaryState:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if "phase" in fields:
            fields["phase"] = Phase(fields["phase"])
        return cls(**fields)


@dataclass(slots=True)
class Window:
    """Requests, errors and a TTFT histogram of one arm in the current step."""

    requests: int = 0
    errors: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))

    def add(self, error: bool, ttft: float | None) -> None:
        self.requests += 1
        self.errors += error
        if ttft is not None:
            self.buckets[bisect.bisect_left(TTFT_BUCKETS, ttft)] += 1

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def ttft_p95(self) -> float | None:
        total = sum(self.buckets)
        if not total:
            return None
        rank, seen = 0.95 * total, 0
        for bound, count in zip(TTFT_BUCKETS, self.buckets, strict=True):
            seen += count
            if seen >= rank:
                return bound
        return None

    def as_fields(self) -> dict[str, int]:
        return {"n": self.requests, "e": self.errors,
                **{f"b{i}": c for i, c in enumerate(self.buckets) if c}}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Window:
        w = cls(int(fields.get("n", 0)), int(fields.get("e", 0)))
        w.buckets = [int(fields.get(f"b{i}", 0)) for i in range(len(TTFT_BUCKETS))]
        return w


def judge(stable: Window, canary: Window, elapsed: float,
          rules: RolloutSection) -> Verdict | None:
    """The verdict on one step's windows; None while there is not enough evidence yet."""
    if canary.requests < rules.min_requests:
        return None
    if canary.error_rate - stable.error_rate > rules.max_error_rate_increase:
        return Verdict.ROLLBACK
    c95, s95 = canary.ttft_p95(), stable.ttft_p95()
    if c95 is not None and s95 is not None and (
            c95 > s95 * rules.max_ttft_p95_ratio + rules.ttft_slack_ms / 1000):
        return Verdict.ROLLBACK
    return Verdict.ADVANCE if elapsed >= rules.interval else None


class Canary:
    def __init__(self, settings: CanarySection, metrics: Metrics,
                 rng: Callable[[], float] = random.random,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._metrics = metrics
        self._rng = rng
        self._clock = clock
        self.events: deque[dict[str, Any]] = deque(maxlen=100)
        self.windows: dict[str, Window] = {}
        self.pending: dict[str, Window] = {}  # not yet flushed to Redis
        rolling = settings.rollout.enabled
        start = settings.rollout.steps[0] if rolling and not settings.weight else settings.weight
        self.state = CanaryState(weight=start, step=0 if rolling else -1,
                                 phase=Phase.ROLLING if rolling else Phase.MANUAL, at=clock(),
                                 why="start")
        self._record(self.state)
        self._adopted()

    def reconfigure(self, settings: CanarySection) -> None:
        """New ``[canary]`` settings (a reload); every reader asks ``settings`` each time."""
        self.settings = settings

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def stable(self) -> str:
        return self.settings.stable

    @property
    def group(self) -> str:
        return self.settings.group

    def weight_of(self, group: str) -> float:
        if group == self.group:
            return self.state.weight
        return 100.0 - self.state.weight if group == self.stable else 0.0

    def draw(self) -> str:
        """An arm for a request with no stored arm, by weight."""
        return self.group if self._rng() * 100.0 < self.state.weight else self.stable

    def draw_for(self, session: str) -> str:
        """A session's first arm: a hash of it against the weight, so that without Redis the
        session still lands in the same arm on every process while the weights stay."""
        digest = hashlib.blake2b(session.encode(), digest_size=8).digest()
        point = int.from_bytes(digest, "big") / 2**64 * 100.0
        return self.group if point < self.state.weight else self.stable

    def shadow(self) -> bool:
        return self.settings.shadow > 0 and self._rng() * 100.0 < self.settings.shadow

    def observe(self, group: str, error: bool, ttft: float | None) -> None:
        if group not in (self.group, self.stable):
            return
        for windows in (self.windows, self.pending):
            windows.setdefault(group, Window()).add(error, ttft)
        if error and group == self.group:
            # What this process saw alone may already condemn the canary: roll back now
            # (the sync loop shares it) instead of waiting for the analyst's next round.
            self.decide(self.windows.get(self.stable, Window()), self.windows[group],
                        rollback_only=True)

    # Operators and the analysis change the state only through here.

    def change(self, who: str, why: str, **changes: Any) -> CanaryState:
        # Versions are milliseconds since the epoch (or one more than ours): a later change
        # on any process wins, and two processes rarely pick the same number.
        now = self._clock()
        version = max(self.state.version + 1, int(now * 1000))
        state = replace(self.state, **changes, version=version, by=who, why=why, at=now)
        self.adopt(state)
        return state

    def adopt(self, state: CanaryState, shared: bool = False) -> bool:
        """Take ``state`` if it is newer than ours. A state read from Redis (``shared``) wins
        a tie too: Redis holds the truth every process follows."""
        if state == self.state or state.version < self.state.version or (
                state.version == self.state.version and not shared):
            return False
        before = self.state
        self.state = state
        if (before.version, before.weight, before.step) != (state.version, state.weight,
                                                          state.step):
            self.windows.clear()
            self.pending.clear()
        self._record(state)
        log.warning("canary: %s%% to %s (step %d, %s%s) by %s: %s", state.weight, self.group,
                    state.step, state.phase, ", paused" if state.paused else "", state.by,
                    state.why or "-")
        self._adopted()
        return True

    def _record(self, state: CanaryState) -> None:
        self.events.appendleft({"at": state.at, "by": state.by, "why": state.why,
                                "weight": state.weight, "step": state.step,
                                "phase": state.phase, "paused": state.paused,
                                "version": state.version})

    def _adopted(self) -> None:
        self._metrics.canary_weight.labels(self.group).set(self.state.weight)
        self._metrics.canary_weight.labels(self.stable).set(100.0 - self.state.weight)
        self._metrics.canary_step.set(self.state.step)

    def decide(self, stable: Window, canary: Window,
               rollback_only: bool = False) -> CanaryState | None:
        """Apply the rollout rules to one step's windows; the new state, if any."""
        state, rules = self.state, self.settings.rollout
        if not rules.enabled or state.paused or state.phase is not Phase.ROLLING:
            return None
        verdict = judge(stable, canary, self._clock() - state.at, rules)
        if verdict is None or (rollback_only and verdict is not Verdict.ROLLBACK):
            return None
        self._metrics.canary_decisions.labels(verdict).inc()
        why = (f"canary {canary.requests} req, {canary.error_rate:.1%} errors, TTFT p95 "
               f"{_ms(canary.ttft_p95())}; stable {stable.requests} req, "
               f"{stable.error_rate:.1%} errors, TTFT p95 {_ms(stable.ttft_p95())}")
        if verdict is Verdict.ROLLBACK:
            return self.change("analysis", f"rolled back: {why}", weight=0.0,
                               phase=Phase.ROLLED_BACK)
        step = state.step + 1
        if step >= len(rules.steps):
            return self.change("analysis", f"promoted: {why}", phase=Phase.PROMOTED)
        phase = Phase.PROMOTED if rules.steps[step] >= 100 else Phase.ROLLING
        return self.change("analysis", f"step {step}: {why}", weight=rules.steps[step],
                           step=step, phase=phase)

    def status(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "stable": self.stable, "canary": self.group,
                "shadow": self.settings.shadow, "state": self.state.to_dict(),
                "steps": list(self.settings.rollout.steps) if self.settings.rollout.enabled
                else [],
                "window": {g: {"requests": w.requests, "errors": w.errors,
                               "ttft_p95_s": w.ttft_p95()} for g, w in self.windows.items()},
                "events": list(self.events)[:20]}

    def __repr__(self) -> str:
        s = self.state
        return (f"<Canary [{self.group} {s.weight:g}% | step {s.step} | {s.phase}"
                f"{' paused' if s.paused else ''} | v{s.version}]>")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
