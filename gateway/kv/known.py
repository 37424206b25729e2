"""What the request path knows of every backend's cache, however it hears vLLM's events:
the index, the estimate for a backend whose events cannot be trusted, the checks of the
index's predictions against what vLLM found, the prefill still to do, and each backend's
standing. One process alone follows the events itself (``gateway.kv.feed.Feeds``); a
serving worker keeps a copy of its control process's index (``gateway.kv.fanout.Mirror``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.kv.estimate import Checks, Estimate
from gateway.kv.index import Index
from gateway.kv.pending import Pending
from gateway.kv.prefill import Prefill

LAG_LIMIT = 2.0  # seconds between a batch's sending (its ts) and its arrival: lagging
UNSYNCED_FOR = 60.0  # seconds a backend that lost events is routed by the estimate
EXACT, ESTIMATED, UNSYNCED, LAGGING, INEXACT = (
    "exact", "estimated", "unsynced", "lagging", "inexact")
STANDINGS = (EXACT, ESTIMATED, UNSYNCED, LAGGING, INEXACT)


@dataclass
class FeedCounts:
    batches: int = 0
    bad: int = 0  # frames or payloads that were not vLLM's: passed over
    gaps: int = 0
    replayed: int = 0  # batches a replay filled in
    resets: int = 0  # the backend's blocks dropped: a restart, a gap no replay filled,
    # or its feed stopped (the backend left the ready ones); kept across its feeds
    last_event: float | None = None  # monotonic time of the last batch applied


@dataclass
class Heard:
    """What a backend's events say of it: whether the index is in step with them (not
    while the first replay runs, nor for UNSYNCED_FOR after events were lost), how late
    the last batch came, and the feed's counts."""

    in_step: bool
    lag: float
    counts: FeedCounts


def in_step(synced: bool, lost_at: float | None) -> bool:
    return synced and (lost_at is None or time.monotonic() - lost_at >= UNSYNCED_FOR)


class Known:
    """The parts every way of hearing the events shares; ``heard`` is each way's own."""

    def __init__(self, index: Index, processes: int = 1,
                 pending: Pending | None = None) -> None:
        self.index = index
        self.estimate = Estimate()
        self.checks = Checks()
        self.prefill = Prefill(processes, pending)
        # Requests tokenized, routed by a conversation's earlier turn, and neither.
        self.lookups = {"asked": 0, "remembered": 0, "unknown": 0}

    def heard(self) -> dict[str, Heard]:
        """Each backend that publishes events (those without are absent)."""
        raise NotImplementedError

    def heard_of(self, backend: str) -> Heard | None:
        return self.heard().get(backend)

    def standing(self, backend: str) -> str:
        """How ``backend`` is routed: ``exact`` (by the index), else by the estimate:
        ``estimated`` (it sends no events), ``unsynced`` (not yet in step, or events lost
        lately), ``lagging`` (its events come late) or ``inexact`` (the index's
        predictions for it keep missing)."""
        heard = self.heard_of(backend)
        if heard is None:
            return ESTIMATED
        if not heard.in_step:
            return UNSYNCED
        if heard.lag >= LAG_LIMIT:
            return LAGGING
        if self.checks.inexact(backend):
            return INEXACT
        return EXACT
