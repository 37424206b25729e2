"""The batch band's share of capacity: grows by one per calm second at full use, halves
when an interactive request waited, never under one or over the most."""

from __future__ import annotations

from gateway.batch.share import BACKOFF, GROW, Share


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_share_grows_while_nobody_waits_and_halves_when_someone_does() -> None:
    clock = Clock()
    share = Share(8, clock)
    assert (share.allowed, share.room) == (1, True)
    share.in_flight = 1
    for _ in range(10):  # calm, and every line it allows in flight
        clock.now += GROW
        share.in_flight = share.allowed
        share.look(0)
    assert share.allowed == 8  # at most the configured concurrency
    share.in_flight = 8
    clock.now += BACKOFF
    share.look(1)  # an interactive request waited
    assert (share.allowed, share.room) == (4, False)
    share.look(2)  # again at once: one halving per BACKOFF
    assert share.allowed == 4
    clock.now += BACKOFF
    share.look(3)
    assert share.allowed == 2
    for waits in range(4, 10):
        clock.now += BACKOFF
        share.look(waits)
    assert share.allowed == 1  # never under one


def test_the_share_does_not_grow_while_it_is_not_used() -> None:
    clock = Clock()
    share = Share(8, clock)
    for _ in range(5):
        clock.now += GROW
        share.look(0)  # nothing in flight: its one place is not even used
    assert share.allowed == 1
