from __future__ import annotations

from backends.backend import Backend, BackendState
from tests.factories import backend


def fresh() -> Backend:
    return backend("a")


def test_first_probe_decides_a_starting_backend() -> None:
    b = fresh()
    assert b.observe_probe(False, fall=3, rise=2)
    assert b.state is BackendState.UNHEALTHY
    b = fresh()
    assert b.observe_probe(True, fall=3, rise=2)
    assert b.state is BackendState.READY and b.flaps == 0


def test_one_failed_probe_never_flips_a_ready_backend() -> None:
    b = fresh()
    b.observe_probe(True, 3, 2)
    for _ in range(5):  # fail, fail, ok: the streak resets
        assert not b.observe_probe(False, 3, 2)
        assert not b.observe_probe(False, 3, 2)
        assert not b.observe_probe(True, 3, 2)
    assert b.state is BackendState.READY


def test_fall_then_rise_counts_flaps() -> None:
    b = fresh()
    b.observe_probe(True, 3, 2)
    results = [b.observe_probe(False, 3, 2) for _ in range(3)]
    assert results == [False, False, True] and b.state is BackendState.UNHEALTHY
    assert [b.observe_probe(True, 3, 2) for _ in range(2)] == [False, True]
    assert b.state is BackendState.READY
    assert b.flaps == 2
    assert repr(b) == "<Backend a [ready | in-flight 0 | models 0 | flaps 2]>"
