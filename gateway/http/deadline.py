"""One deadline per request, across its phases, at almost no cost per chunk.

Phases: the body must arrive by one time, the response headers by another, and then
each chunk must follow the previous one within ``idle`` (and all by ``total``).
``asyncio.timeout`` per phase and a reschedule per chunk showed up at ~8-10 % of the
gateway's CPU under load. Here a chunk only stamps ``last``; the single timer wakes at
the earliest possible expiry and re-arms itself when the due time has moved on.
"""

from __future__ import annotations

import asyncio


class Deadline:
    __slots__ = ("_armed", "_due", "_handle", "_idle", "_loop", "_task", "_total", "expired",
                 "last")

    def __init__(self, due: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._due = due
        self._idle: float | None = None
        self._total = due
        self.last = 0.0
        self.expired = False
        self._armed = due
        self._handle = self._loop.call_at(due, self._check)

    def until(self, due: float) -> None:
        """A new phase that must be over by ``due`` (loop time)."""
        self._idle = None
        self._due = due
        if due < self._armed:
            self._arm(due)

    def stream(self, idle: float, total: float) -> None:
        """From now on: a chunk at least every ``idle`` seconds, all by ``total``."""
        self.last = self._loop.time()
        self._idle = idle
        self._total = total
        due = min(self.last + idle, total)
        if due < self._armed:
            self._arm(due)

    def touch(self) -> None:
        self.last = self._loop.time()

    def absorb(self) -> bool:
        """True when this deadline cancelled the task; the cancellation is then undone."""
        if self.expired and self._task.uncancel() == 0:
            self.expired = False
            return True
        return False

    def cancel(self) -> None:
        self._handle.cancel()

    def _current(self) -> float:
        if self._idle is None:
            return self._due
        return min(self.last + self._idle, self._total)

    def _check(self) -> None:
        due = self._current()
        if self._loop.time() >= due:
            self.expired = True
            self._armed = float("inf")  # nothing armed until the next phase
            self._task.cancel("deadline")
        else:
            self._arm(due)

    def _arm(self, due: float) -> None:
        self._handle.cancel()
        self._armed = due
        self._handle = self._loop.call_at(due, self._check)
