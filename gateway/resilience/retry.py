"""How many retries the gateway may spend: a budget, not a per-request count.

Every client request deposits ``ratio`` of a retry (the balance is capped); every retry
withdraws one. So upstream attempts stay under (1 + ratio) x requests + the floor, also
when every backend fails at once: no retry storm. (Finagle's RetryBudget, without time.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from email.utils import parsedate_to_datetime

RETRIABLE = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 300.0


class RetryBudget:
    def __init__(self, ratio: float = 0.2, floor: int = 3, cap: float = 100.0) -> None:
        self._ratio = ratio
        self._cap = max(cap, float(floor))
        self.balance = float(floor)
        self.exhausted = 0  # retries refused for lack of budget

    def deposit(self) -> None:
        self.balance = min(self._cap, self.balance + self._ratio)

    def can_withdraw(self) -> bool:
        return self.balance >= 1.0

    def withdraw(self) -> bool:
        if self.balance >= 1.0:
            self.balance -= 1.0
            return True
        self.exhausted += 1
        return False

    def __repr__(self) -> str:
        return f"<RetryBudget [balance {self.balance:.1f} | exhausted {self.exhausted}]>"


def backoff(attempt: int, base: float, jitter: Callable[[], float] = random.random) -> float:
    """Full jitter: uniform in [0, base x 2^(attempt-1)]."""
    return base * 2.0 ** max(attempt - 1, 0) * jitter()


def retry_after(value: bytes | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            from datetime import UTC, datetime

            seconds = (parsedate_to_datetime(text) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return max(0.0, min(seconds, MAX_RETRY_AFTER))
