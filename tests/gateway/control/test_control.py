"""The control process's bookkeeping of its workers, and a worker's adoption of what it
publishes, without processes: the in-flight sum a drain waits on, and which changes a
worker takes on."""

from __future__ import annotations

import asyncio

from backends.backend import Backend, BackendState
from gateway.control.link import ControlLink
from gateway.control.server import FIRST_REPORT, SILENT, Workers
from gateway.routing.pool import BackendPool
from tests.factories import backend

SPAWN = {"model": "m", "port": 9}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool(*backends: Backend) -> BackendPool:
    return BackendPool(backends)


def test_in_flight_is_the_sum_over_the_workers_that_are_alive() -> None:
    b = backend("b", ready=True)
    workers = Workers(pool(b), {})
    workers.add(1)
    workers.add(2)
    workers.report(1, {"b": (3, "ready")})
    workers.report(2, {"b": (4, "ready")})
    assert b.in_flight == 7
    workers.report(3, {"b": (100, "ready")})  # not a worker of ours: ignored
    assert b.in_flight == 7
    workers.forget(2)  # its requests ended with it
    assert b.in_flight == 3


def test_a_worker_that_has_not_seen_a_drain_counts_as_busy() -> None:
    b = backend("b", ready=True)
    workers = Workers(pool(b), {})
    for pid in (1, 2):
        workers.add(pid)
        workers.report(pid, {"b": (0, "ready")})
    b.drain()
    workers.report(1, {"b": (0, "draining")})
    assert b.in_flight == 1  # worker 2 may still route to b
    workers.report(2, {"b": (0, "draining")})
    assert b.in_flight == 0


def test_settle_waits_for_a_report_from_every_worker() -> None:
    clock = Clock()
    b = backend("b", ready=True)
    workers = Workers(pool(b), {}, clock=clock)
    workers.add(1)
    workers.add(2)

    async def scenario() -> bool:
        settling = asyncio.ensure_future(workers.settle(within=60, poll=0.001))
        await asyncio.sleep(0.01)
        clock.now = 1.0
        workers.report(1, {"b": (0, "ready")})
        await asyncio.sleep(0.01)
        waiting = not settling.done()
        workers.report(2, {"b": (0, "ready")})
        await asyncio.wait_for(settling, 1)
        return waiting

    assert asyncio.run(scenario())


def test_published_lives_carry_the_supervisor_fields() -> None:
    b = backend("s", spawn=SPAWN)
    b.mark_ready()
    b.models = frozenset({"m2", "m1"})
    published = Workers(pool(b), {}).published()
    assert published["s"]["state"] == "ready" and published["s"]["problem"] is None
    assert published["s"]["models"] == ["m1", "m2"]


def link_for(*backends: Backend) -> ControlLink:
    return ControlLink("/nonexistent", pool(*backends))


def test_a_worker_adopts_a_spawned_backends_life() -> None:
    s = backend("s", spawn=SPAWN)
    link = link_for(s)
    link.adopt({"s": {"state": "ready", "pid": 42, "started_at": 1.0, "restarts": 2,
                      "problem": None, "models": ["m1"]}})
    assert s.state is BackendState.READY and s.pid == 42 and s.restarts == 2
    assert s.models == {"m1"}  # routable at once, before this worker's own probe


def test_a_url_backend_keeps_its_own_probes_until_an_operator_acts() -> None:
    u = backend("u", ready=True)
    link = link_for(u)
    starting = {"u": {"state": "starting", "pid": None, "started_at": None, "restarts": 0,
                      "problem": None}}
    link.adopt(starting)
    assert u.state is BackendState.READY  # the control process's idea of a url backend
    link.adopt(starting)
    assert u.state is BackendState.READY  # no change there: nothing adopted
    link.adopt({"u": {**starting["u"], "state": "draining"}})
    assert u.state is BackendState.DRAINING
    link.adopt(starting)  # started again by an operator: probes decide from here
    assert u.state is BackendState.STARTING


def test_between_changes_a_workers_own_probes_decide() -> None:
    s = backend("s", spawn=SPAWN)
    link = link_for(s)
    ready = {"s": {"state": "ready", "pid": 1, "started_at": 1.0, "restarts": 0,
                   "problem": None}}
    link.adopt(ready)
    assert s.observe_probe(False, fall=1, rise=1)  # this worker's probes: unhealthy
    link.adopt(ready)
    assert s.state is BackendState.UNHEALTHY


def test_a_backend_a_reload_made_anew_adopts_at_once() -> None:
    old = backend("s", spawn=SPAWN)
    backends = pool(old)
    link = ControlLink("/nonexistent", backends)
    ready = {"s": {"state": "ready", "pid": 1, "started_at": 1.0, "restarts": 0,
                   "problem": None}}
    link.adopt(ready)
    new = backend("s", spawn=SPAWN)  # same name, a new object (its spec changed)
    backends.replace([new])
    link.adopt(ready)  # the same state as before, but new to this object
    assert new.state is BackendState.READY


def test_a_worker_that_stops_reporting_is_silent_and_a_new_one_has_longer() -> None:
    clock = Clock()
    workers = Workers(pool(), {}, clock)
    workers.add(1)
    workers.add(2)
    workers.report(1, {})
    clock.now = SILENT - 0.1
    assert workers.silent() == {}
    clock.now = SILENT + 0.1
    assert set(workers.silent()) == {1}  # 2 has not reported yet: it may still be starting
    workers.report(2, {})
    clock.now = FIRST_REPORT + 1
    assert set(workers.silent()) == {1, 2}
    workers.forget(1)
    assert set(workers.silent()) == {2}


def test_a_pause_of_the_control_process_makes_nobody_silent() -> None:
    clock = Clock()
    workers = Workers(pool(), {}, clock)
    workers.add(1)
    workers.add(2)
    workers.report(1, {})
    clock.now = FIRST_REPORT + 10  # nobody could report while this process was stopped
    workers.excuse()
    assert workers.silent() == {}
    clock.now += SILENT + 0.1
    assert set(workers.silent()) == {1}  # reported before: silent again; 2 still starting
