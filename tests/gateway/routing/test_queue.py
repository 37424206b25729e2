"""The gateway's queue alone (issue 37): who a freed place wakes (highest band first, round
robin across tenants within it), how it stays bounded (the newest of the busiest tenant
goes, a lower band's first), and the wait's end (503), with no backend or process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.config.tenancy import QueueSection
from gateway.errors import Shed
from gateway.metrics import Metrics
from gateway.routing.queue import WaitQueue


def scenario(body: Callable[[WaitQueue, list[str]], Awaitable[None]],
             **settings: Any) -> list[str]:
    """Run ``body`` with a queue; returns the order waiters were let go in (or refused)."""
    order: list[str] = []

    async def main() -> None:
        await body(WaitQueue(QueueSection(**settings), Metrics(), tenants=2), order)

    asyncio.run(asyncio.wait_for(main(), 10))
    return order


async def waiting(queue: WaitQueue, order: list[str], label: str, band: int,
                  tenant: str) -> asyncio.Task[None]:
    """A waiter, queued by the time this returns."""
    async def wait() -> None:
        try:
            await queue.wait(band, tenant)
            order.append(label)
        except Shed as exc:
            order.append(f"{label}:{exc.code}")

    before = queue.waiting
    task = asyncio.create_task(wait())
    while queue.waiting == before and not task.done():  # noqa: ASYNC110 (its own count)
        await asyncio.sleep(0)
    return task


async def free_all(queue: WaitQueue, tasks: list[asyncio.Task[None]]) -> None:
    for _ in tasks:
        queue.freed()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)


def test_the_highest_band_first_then_tenants_in_turn() -> None:
    async def body(queue: WaitQueue, order: list[str]) -> None:
        tasks = [await waiting(queue, order, label, band, tenant) for label, band, tenant in (
            ("a1", 0, "a"), ("a2", 0, "a"), ("a3", 0, "a"), ("b1", 0, "b"), ("vip", 5, "v"))]
        await free_all(queue, tasks)

    assert scenario(body) == ["vip", "a1", "b1", "a2", "a3"]


def test_a_full_queue_lets_the_busiest_tenants_newest_go_not_a_quiet_tenant() -> None:
    async def body(queue: WaitQueue, order: list[str]) -> None:
        tasks = [await waiting(queue, order, f"a{n}", 0, "a") for n in (1, 2, 3)]
        tasks.append(await waiting(queue, order, "b1", 0, "b"))  # full: a3 is let go
        await asyncio.sleep(0)
        with pytest.raises(Shed):  # a's own fourth: a has the most already
            await queue.wait(0, "a")
        await free_all(queue, [t for t in tasks if not t.done()])
        await asyncio.gather(*tasks)

    assert scenario(body, max_length=3) == ["a3:queue_full", "a1", "b1", "a2"]


def test_a_lower_bands_waiter_makes_room_for_a_higher_one() -> None:
    async def body(queue: WaitQueue, order: list[str]) -> None:
        low = await waiting(queue, order, "low", 0, "a")
        high = await waiting(queue, order, "high", 5, "a")
        await free_all(queue, [high])
        await low

    assert scenario(body, max_length=1) == ["low:queue_full", "high"]


def test_a_wait_that_runs_out_is_a_503_to_retry() -> None:
    async def body(queue: WaitQueue, order: list[str]) -> None:
        await (await waiting(queue, order, "late", 0, "a"))

    assert scenario(body, max_wait=0.05) == ["late:queue_timeout"]


def test_a_waiter_whose_client_left_is_gone_from_the_queue() -> None:
    """Its task cancelled (the client hung up): the next freed place goes to the next."""
    async def body(queue: WaitQueue, order: list[str]) -> None:
        gone = await waiting(queue, order, "gone", 0, "a")
        next_ = await waiting(queue, order, "next", 0, "a")
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert queue.waiting == 1
        queue.freed()
        await next_

    assert scenario(body) == ["next"]


def test_a_waiter_woken_as_its_client_leaves_passes_the_place_on() -> None:
    """Woken, and cancelled before it ran (its client hung up meanwhile): it leaves, and the
    next waiter gets the place (on Python 3.11 ``asyncio.wait_for`` returned instead)."""
    async def body(queue: WaitQueue, order: list[str]) -> None:
        gone = await waiting(queue, order, "gone", 0, "a")
        next_ = await waiting(queue, order, "next", 0, "b")
        queue.freed()  # wakes "gone"...
        gone.cancel()  # ...whose client leaves before it runs
        await asyncio.gather(gone, return_exceptions=True)
        await next_

    assert scenario(body) == ["next"]


def test_a_waiter_woken_in_the_turn_its_wait_runs_out_goes() -> None:
    """A place freed in the very loop turn a waiter's ``max_wait`` ends: the waiter takes it
    (it was woken) instead of a 503 that would lose the wake. The loop's clock is the
    test's, so both fall due in one turn."""
    async def body(queue: WaitQueue, order: list[str]) -> None:
        loop = asyncio.get_running_loop()
        now = [loop.time()]
        loop.time = lambda: now[0]  # type: ignore[method-assign]
        first = await waiting(queue, order, "first", 0, "a")
        loop.call_at(now[0] + 1.0 - 1e-6, queue.freed)
        now[0] += 1.0  # its timeout and the freed place, in the same turn
        await first

    assert scenario(body, max_wait=1.0) == ["first"]
