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


def test_slower_interactive_requests_halve_the_share_without_any_wait() -> None:
    clock = Clock()
    share = Share(8, clock)
    for _ in range(7):
        clock.now += GROW
        share.in_flight = share.allowed
        share.look(0)
    assert share.allowed == 8
    clock.now += BACKOFF
    share.look(0, slowed=True)  # nobody waited, but their first bytes came later
    assert share.allowed == 4


def test_the_pulse_rises_with_slower_first_bytes_and_its_mark_drifts_up_to_a_new_normal(
        ) -> None:
    from gateway.routing.queue import Pulse

    clock = Clock()
    pulse = Pulse(clock)
    assert not pulse.raised  # nothing seen yet
    for _ in range(50):  # 100 ms each: the normal
        clock.now += 0.05
        pulse.note(0.100)
    assert not pulse.raised and abs((pulse.low or 0) - 0.100) < 1e-3
    for _ in range(10):  # a batch slows every request beside it
        clock.now += 0.05
        pulse.note(0.300)
    assert pulse.raised
    for _ in range(40):  # back to normal once the share halved
        clock.now += 0.05
        pulse.note(0.100)
    assert not pulse.raised
    for _ in range(400):  # 120 ms for good (longer prompts, say): the mark follows
        clock.now += 1.0
        pulse.note(0.120)
    assert not pulse.raised and (pulse.low or 0) > 0.112
