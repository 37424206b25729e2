from __future__ import annotations

import asyncio

import pytest

from gateway.deadline import StreamDeadline


def test_touches_keep_a_stream_alive_past_its_idle_time() -> None:
    async def main() -> bool:
        with StreamDeadline(idle=0.1, deadline=asyncio.get_running_loop().time() + 60) as t:
            for _ in range(6):  # 0.3 s in all, never 0.1 s without a touch
                await asyncio.sleep(0.03)
                t.touch()
            return t.expired

    assert asyncio.run(main()) is False


def test_idle_gap_cancels_the_task() -> None:
    async def main() -> StreamDeadline:
        t = StreamDeadline(idle=0.05, deadline=asyncio.get_running_loop().time() + 60)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)
        return t

    assert asyncio.run(main()).expired


def test_total_deadline_wins_over_touches() -> None:
    async def main() -> StreamDeadline:
        t = StreamDeadline(idle=10, deadline=asyncio.get_running_loop().time() + 0.1)
        with pytest.raises(asyncio.CancelledError):
            while True:
                await asyncio.sleep(0.01)
                t.touch()
        return t

    assert asyncio.run(main()).expired
