"""Idle and total deadlines for a relayed response, at almost no cost per chunk.

Rescheduling a timer on every chunk showed up at ~8 % of the gateway's CPU under load.
Here a chunk only stamps ``last``; the one timer wakes at the earliest possible expiry,
and re-arms itself if a chunk came in the meantime.
"""

from __future__ import annotations

import asyncio


class StreamDeadline:
    __slots__ = ("_deadline", "_handle", "_idle", "_loop", "_task", "expired", "last")

    def __init__(self, idle: float, deadline: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._idle = idle
        self._deadline = deadline
        self.expired = False
        self.last = self._loop.time()
        self._handle = self._loop.call_at(min(self.last + idle, deadline), self._check)

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        due = min(self.last + self._idle, self._deadline)
        if self._loop.time() >= due:
            self.expired = True
            self._task.cancel("stream deadline")
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        self._handle.cancel()

    def __enter__(self) -> StreamDeadline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
