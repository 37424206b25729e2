from __future__ import annotations

from gateway.resilience.retry import RetryBudget, backoff, retry_after


def test_budget_allows_ratio_of_requests_plus_floor() -> None:
    budget = RetryBudget(ratio=0.2, floor=3)
    retries = 0
    for _ in range(100):
        budget.deposit()
        while budget.withdraw():
            retries += 1
    assert retries == 3 + 20
    assert budget.exhausted > 0


def test_full_jitter_backoff_and_retry_after() -> None:
    assert backoff(1, 0.1, lambda: 1.0) == 0.1
    assert backoff(3, 0.1, lambda: 0.5) == 0.2
    assert retry_after(b"7") == 7.0
    assert retry_after(b"100000") == 300.0
    assert retry_after(b"soon") is None
    assert retry_after(None) is None
    assert retry_after(b"Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
