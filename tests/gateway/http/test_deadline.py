from __future__ import annotations

import asyncio

import pytest

from gateway.http.deadline import Deadline


def now() -> float:
    return asyncio.get_running_loop().time()


def test_touches_keep_a_stream_alive_past_its_idle_time() -> None:
    async def main() -> bool:
        d = Deadline(now() + 60)
        d.stream(idle=0.5, total=now() + 60)
        for _ in range(20):  # 1 s in all, twice the idle time; never 1/10 of it untouched
            await asyncio.sleep(0.05)
            d.touch()
        d.cancel()
        return d.expired

    assert asyncio.run(main()) is False


def test_idle_gap_cancels_the_task_and_absorb_undoes_it() -> None:
    async def main() -> bool:
        d = Deadline(now() + 60)
        d.stream(idle=0.05, total=now() + 60)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return d.absorb()
        return False

    assert asyncio.run(main()) is True


def test_total_wins_over_touches() -> None:
    async def main() -> None:
        d = Deadline(now() + 60)
        d.stream(idle=10, total=now() + 0.1)
        while True:
            await asyncio.sleep(0.01)
            d.touch()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_an_earlier_phase_due_re_arms_and_a_later_one_waits() -> None:
    async def main() -> tuple[bool, bool]:
        d = Deadline(now() + 60)
        d.until(now() + 0.05)  # earlier than armed: must fire soon
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            first = d.absorb()
        d.until(now() + 30)  # a later phase after an early timer: fires only at its due
        await asyncio.sleep(0.1)
        second = not d.expired
        d.cancel()
        return first, second

    assert asyncio.run(main()) == (True, True)


def test_a_foreign_cancel_is_not_absorbed() -> None:
    async def main() -> bool:
        d = Deadline(now() + 60)
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, task.cancel)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return d.absorb()
        finally:
            d.cancel()
        return True

    assert asyncio.run(main()) is False
