"""The rollout rules and the shared-state rules of the canary, driven by hand."""

from __future__ import annotations

from gateway.canary.rollout import Canary, CanaryState, Window, judge
from gateway.config import CanarySection, RolloutSection
from gateway.metrics import Metrics

RULES = RolloutSection(enabled=True, steps=(10.0, 50.0, 100.0), min_requests=10, interval=5.0)


def window(requests: int, errors: int = 0, ttft: float = 0.02) -> Window:
    w = Window()
    for i in range(requests):
        w.add(i < errors, ttft)
    return w


def test_no_verdict_before_the_sample_is_complete() -> None:
    assert judge(window(100), window(9, errors=9), 60, RULES) is None


def test_error_rate_and_ttft_against_stable_roll_back() -> None:
    assert judge(window(100, errors=1), window(10, errors=1), 60, RULES) == "rollback"  # +9 %
    assert judge(window(100, errors=10), window(10, errors=1), 60, RULES) == "advance"
    assert judge(window(100), window(10, errors=1), 60, RULES) == "rollback"
    assert judge(window(100, ttft=0.02), window(10, ttft=0.5), 60, RULES) == "rollback"
    assert judge(window(100, ttft=0.02), window(10, ttft=0.05), 60, RULES) == "advance"  # slack


def test_advance_waits_for_the_step_interval() -> None:
    assert judge(window(10), window(10), 4.9, RULES) is None
    assert judge(window(10), window(10), 5.0, RULES) == "advance"


def test_decisions_walk_the_steps_and_stop_at_promoted() -> None:
    now = [1000.0]
    canary = Canary(CanarySection(enabled=True, rollout=RULES), Metrics(), clock=lambda: now[0])
    assert canary.state.weight == 10 and canary.state.phase == "rolling"
    weights = []
    for _ in range(4):
        now[0] += 10
        state = canary.decide(window(20), window(20))
        weights.append(None if state is None else state.weight)
    assert weights == [50, 100, None, None]
    assert canary.state.phase == "promoted"


def test_a_paused_rollout_decides_nothing_and_a_rollback_is_immediate() -> None:
    canary = Canary(CanarySection(enabled=True, rollout=RULES), Metrics(), clock=lambda: 1e6)
    canary.change("op", "hold", paused=True)
    assert canary.decide(window(20), window(20, errors=20)) is None
    canary.change("op", "go", paused=False)
    for _ in range(10):
        canary.observe("canary", True, None)  # the tenth error completes the sample
    assert canary.state.phase == "rolled_back" and canary.state.weight == 0


def test_the_draw_follows_the_weight() -> None:
    values = iter(i / 1000 for i in range(1000))
    canary = Canary(CanarySection(enabled=True, weight=5), Metrics(), rng=lambda: next(values))
    drawn = [canary.draw() for _ in range(1000)]
    assert drawn.count("canary") == 50


def test_redis_wins_a_tie_and_an_older_state_is_ignored() -> None:
    canary = Canary(CanarySection(enabled=True), Metrics(), clock=lambda: 5.0)
    mine = canary.change("me", "x", weight=10)
    assert not canary.adopt(CanaryState(weight=99, version=mine.version - 1), shared=True)
    assert canary.adopt(CanaryState(weight=20, version=mine.version), shared=True)
    assert canary.state.weight == 20
    assert not canary.adopt(CanaryState(weight=30, version=mine.version))  # local tie: no
