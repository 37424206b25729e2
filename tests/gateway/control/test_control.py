"""The control process's bookkeeping of its workers, and a worker's adoption of what it
publishes, without processes: the in-flight sum a drain waits on, and which changes a
worker takes on."""

from __future__ import annotations

import asyncio

import orjson

from backends.backend import Backend, BackendState, GpuReading, LoadReport
from gateway.build import build
from gateway.control.link import ControlLink
from gateway.control.role import Kind, Role
from gateway.control.server import FIRST_REPORT, SILENT, WorkerTable
from gateway.control.snapshot import encode
from gateway.routing.pool import BackendPool
from tests.factories import backend, config

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
    workers = WorkerTable(pool(b), {})
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
    workers = WorkerTable(pool(b), {})
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
    workers = WorkerTable(pool(b), {}, clock=clock)
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


def test_the_snapshot_carries_each_life_and_versions_only_changes() -> None:
    b = backend("s", spawn=SPAWN)
    snapshot = WorkerTable(pool(b), {}).snapshot
    first = snapshot()
    assert first["version"] == 1 and first["backends"]["s"]["state"] == "starting"
    assert snapshot()["version"] == 1  # nothing changed: the same version
    b.mark_ready()
    b.models = frozenset({"m2", "m1"})
    b.load = LoadReport(running=3, waiting=1, kv_usage=0.5,
                        gpus=(GpuReading(0, 10, 80, 60),))
    published = snapshot()
    assert published["version"] == 2
    life = published["backends"]["s"]
    assert life["state"] == "ready" and life["problem"] is None
    assert life["models"] == ["m1", "m2"]


def test_what_the_control_publishes_is_what_a_worker_adopts() -> None:
    """The contract between the two sides, through JSON as on the socket."""
    source = backend("s", spawn=SPAWN)
    source.mark_ready()
    source.pid, source.restarts, source.started_at = 42, 2, 1.0
    source.learn(frozenset({"m1"}), {"m1": {"id": "m1", "max_model_len": 512}})
    source.load = LoadReport(running=3, waiting=1, kv_usage=0.5, prefix_hit_ratio=0.25,
                             gpus=(GpuReading(0, 10, 80, 60),))
    source.last_probe, source.flaps = "ok", 3
    copy = backend("s", spawn=SPAWN)
    link = ControlLink("/nonexistent", pool(copy))
    link.adopt(orjson.loads(orjson.dumps(WorkerTable(pool(source), {}).snapshot())))
    assert copy.life() == source.life()


def test_a_worker_adopts_only_a_new_version_or_a_backend_new_to_it() -> None:
    u = backend("u")
    backends = pool(u)
    link = ControlLink("/nonexistent", backends)
    ready = {"version": 3, "backends": {"u": encode(backend("u", ready=True), None)}}
    link.adopt(ready)
    assert u.state is BackendState.READY
    u.drain()  # (not something a worker does: only to see what is adopted)
    link.adopt(ready)
    assert u.state is BackendState.DRAINING  # the same version: nothing adopted
    new = backend("u", "http://127.0.0.1:2")  # a reload made it anew (its spec changed)
    backends.replace([new])
    link.adopt(ready)
    assert new.state is BackendState.READY  # the same version, but new to this object
    new.mark_busy(30)
    link.adopt({**ready, "version": 4})
    assert new.state is BackendState.READY and new.busy_until  # its own: kept


def test_a_worker_that_stops_reporting_is_silent_and_a_new_one_has_longer() -> None:
    clock = Clock()
    workers = WorkerTable(pool(), {}, clock)
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
    workers = WorkerTable(pool(), {}, clock)
    workers.add(1)
    workers.add(2)
    workers.report(1, {})
    clock.now = FIRST_REPORT + 10  # nobody could report while this process was stopped
    workers.excuse()
    assert workers.silent() == {}
    clock.now += SILENT + 0.1
    assert set(workers.silent()) == {1}  # reported before: silent again; 2 still starting


def test_the_replicas_counts_are_summed_over_its_workers() -> None:
    a, b = backend("a", ready=True), backend("b", ready=True)
    workers = WorkerTable(pool(a, b), {})
    workers.add(1)
    workers.add(2)
    workers.report(1, {"a": (2, "ready")}, {"a": 3})
    workers.report(2, {"a": (1, "ready"), "b": (4, "ready")}, {"a": 1, "b": 2})
    assert workers.replica() == {"in_flight": {"a": 3, "b": 4}, "pins": {"a": 4, "b": 2},
                                 "degraded": []}
    workers.forget(1)
    assert workers.replica() == {"in_flight": {"a": 1, "b": 4}, "pins": {"a": 1, "b": 2},
                                 "degraded": []}


def test_every_workers_degraded_replies_are_the_replicas_newest_first() -> None:
    """The status page's recent degraded replies are the whole replica's whichever worker
    answers (each worker tells only what it gave since its last report)."""
    workers = WorkerTable(pool(backend("a", ready=True)), {})
    workers.add(1)
    workers.add(2)

    def given(at: float) -> dict[str, object]:
        return {"at": at, "id": f"r{at:g}", "model": "m", "kind": "static", "why": "x"}

    workers.report(1, {}, {}, [given(3.0), given(1.0)])
    workers.report(2, {}, {}, [given(2.0)])
    workers.report(1, {}, {})  # nothing new
    assert [e["id"] for e in workers.replica()["degraded"]] == ["r3", "r2", "r1"]
    workers.report(2, {}, {}, [given(10.0 + n) for n in range(25)])
    recent = workers.replica()["degraded"]
    assert len(recent) == 20 and recent[0]["id"] == "r34" and recent[-1]["id"] == "r15"


def test_the_control_process_builds_nothing_of_the_request_path() -> None:
    """It serves no request: no proxy, HTTP client, router, reply cache or queue is built
    there (a worker and a single process build them); its status shows no pins of its own."""
    settings = config(backends=[{"name": "a", "url": "http://a.test:8000"}],
                      routing={"sticky": False}, breaker={"share": False},
                      degraded={"cache": False})
    control = build(settings, role=Role(Kind.CONTROL))
    assert control.serving is None and control.reloadable.queue is None
    assert [b["pins"] for b in control.status.data()["backends"]] == [0]
    assert control.status.data()["degraded"] == []
    single = build(settings)
    assert single.serving is not None and single.reloadable.queue is single.serving.queue
