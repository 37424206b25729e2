"""Instances started and stopped by demand (``gateway.control.demand``) and the requests
that wait for them (``gateway.request.waking``), without processes: an on-demand instance
is not started at boot but when its model is wanted, once; an idle one is drained and
stopped after ``stop_after`` and started again when wanted; a failed one stays failed."""

from __future__ import annotations

import asyncio
from typing import Any

from backends.backend import Backend, BackendState, GpuReading, LoadReport
from backends.health import ProbeResult
from backends.supervisor import Supervisor, SupervisorSettings
from gateway.control.demand import Demand
from gateway.request.waking import Waking
from gateway.routing.pool import BackendPool
from tests.factories import backend


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeSupervisor:
    """Starts and stops at once: the backend is ready when started, stopped when stopped."""

    def __init__(self, backend: Backend, sequential: bool = False) -> None:
        self.backend = backend
        self.sequential = sequential
        self.started = self.stopped = 0

    def start(self) -> bool:
        self.started += 1
        return True

    async def drain_and_stop(self) -> bool:
        self.backend.drain()
        self.stopped += 1
        self.backend.stop()
        return True

    async def drained(self) -> bool:
        self.backend.drain()
        return True

    async def stop(self) -> None:
        self.stopped += 1
        self.backend.stop()

    async def restart(self) -> None:
        self.restarted = getattr(self, "restarted", 0) + 1
        self.backend.start_over()


class FakeSleeper:
    """vLLM's sleep routes, always obliging; ``answers``: what each check returns."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, int]] = []

    async def sleep(self, backend: Backend, level: int) -> bool:
        self.calls.append(("sleep", level))
        return True

    async def wake(self, backend: Backend, level: int) -> bool:
        self.calls.append(("wake", level))
        return True

    async def answer(self, backend: Backend) -> str | None:
        return self.answers.pop(0)


def spawned(name: str, model: str = "m", **spawn: Any) -> Backend:
    # A command of its own: sleep_after is then not refused where vLLM has no sleep mode.
    return backend(name, spawn={"model": model, "port": 9, "command": ["vllm"], **spawn})


def demand(*backends: Backend, wanted: set[str] | None = None, sleeper: Any = None
           ) -> tuple[Demand, dict[str, FakeSupervisor], Clock, set[str]]:
    clock, asked = Clock(), wanted if wanted is not None else set()
    supervisors = {b.name: FakeSupervisor(b) for b in backends}
    d = Demand(BackendPool(backends), supervisors,  # type: ignore[arg-type]
               lambda: {b.name: b.uses for b in backends}, lambda: asked, clock,
               sleeper=sleeper)
    return d, supervisors, clock, asked


def test_an_on_demand_instance_starts_at_its_models_first_request_once() -> None:
    async def test() -> None:
        lazy, other = spawned("lazy", start="on_demand"), spawned("boot", model="n")
        d, supervisors, _, asked = demand(lazy, other)
        lazy.stop()  # as the gateway's start leaves it (waits_for_demand)
        d.look()
        assert supervisors["lazy"].started == 0  # nobody asked
        asked.add("m")
        d.look()
        d.look()  # wanted still, and starting: not started twice
        assert supervisors["lazy"].started == 1 and lazy.state is BackendState.STARTING
        assert d.starts == 1
    asyncio.run(test())


def test_an_on_demand_instance_waits_for_demand_instead_of_starting() -> None:
    real = {b.name: Supervisor(b, SupervisorSettings(), probe)
            for b in (spawned("lazy", start="on_demand"), spawned("boot", model="n"),
                      spawned("idle", model="o", stop_after=60, sleep_after=30))}
    assert [s.waits_for_demand() for s in real.values()] == [True, False, False]
    assert real["lazy"].backend.state is BackendState.STOPPED
    assert real["boot"].backend.state is BackendState.STARTING


async def probe(_: Backend) -> ProbeResult:
    return ProbeResult(ok=False)


def test_an_idle_instance_stops_after_stop_after_and_comes_back_when_wanted() -> None:
    async def test() -> None:
        idle = spawned("idle", stop_after=30)
        idle.mark_ready()
        d, supervisors, clock, asked = demand(idle)
        d.look()  # first seen ready: its idle time starts
        clock.now = 20
        idle.uses += 1  # a request went there meanwhile
        d.look()
        clock.now = 45
        d.look()
        assert supervisors["idle"].stopped == 0  # 25 s since that request
        clock.now = 51
        d.look()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert supervisors["idle"].stopped == 1 and idle.state is BackendState.STOPPED
        asked.add("m")
        d.look()
        assert supervisors["idle"].started == 1 and d.stops == 1
    asyncio.run(test())


def test_an_instance_with_requests_in_flight_is_never_idle() -> None:
    async def test() -> None:
        busy = spawned("busy", stop_after=5)
        busy.mark_ready()
        busy.in_flight = 1  # one long stream, and nothing new
        d, supervisors, clock, _ = demand(busy)
        for now in range(0, 60, 5):
            clock.now = now
            d.look()
        assert supervisors["busy"].stopped == 0
    asyncio.run(test())


def test_a_stopped_instance_starts_when_wanted_a_failed_one_does_not() -> None:
    async def test() -> None:
        stopped, failed = spawned("stopped", stop_after=5), spawned("failed", model="n",
                                                                     start="on_demand")
        stopped.stop()  # by the admin verb: the gateway owns an on-demand instance's life
        failed.fail()
        d, supervisors, _, _ = demand(stopped, failed, wanted={"m", "n"})
        d.look()
        assert supervisors["stopped"].started == 1 and supervisors["failed"].started == 0
    asyncio.run(test())


def test_a_request_waits_while_its_models_instance_starts() -> None:
    async def test() -> None:
        lazy = spawned("lazy", start="on_demand", wake_timeout=5)
        lazy.stop()
        waking = Waking(BackendPool([lazy]))
        assert waking.within("m") == 5 and waking.within("other") is None
        waiting = asyncio.create_task(waking("m", 5))
        await asyncio.sleep(0.1)
        assert not waiting.done() and waking.wanted() == ["m"]
        lazy.start_over()
        lazy.mark_ready()
        lazy.models = frozenset({"m"})  # what its /v1/models says once up
        await asyncio.wait_for(waiting, 1)
        assert waking.within("m") is None  # up: nobody waits
    asyncio.run(test())


def test_a_request_gives_up_after_the_wake_timeout() -> None:
    async def test() -> None:
        lazy = spawned("lazy", start="on_demand", wake_timeout=0.2)
        lazy.stop()
        waking = Waking(BackendPool([lazy]))
        began = asyncio.get_running_loop().time()
        within = waking.within("m")
        assert within == 0.2
        await asyncio.wait_for(waking("m", within), 2)
        assert asyncio.get_running_loop().time() - began >= 0.2
    asyncio.run(test())


def test_a_stopped_or_sleeping_model_is_still_listed_a_failed_one_is_not() -> None:
    never_run, asleep = spawned("lazy", start="on_demand"), spawned("s", model="n",
                                                                    sleep_after=60)
    never_run.stop()  # never ran: listed by the name it is configured to serve
    asleep.models = frozenset({"n"})
    asleep.fall_asleep(1)
    pool = BackendPool([never_run, asleep])
    assert pool.models() == ["m", "n"] and list(pool.cards()) == ["m", "n"]
    never_run.fail()
    assert pool.models() == ["n"]


def test_a_request_stops_waiting_when_its_instance_fails() -> None:
    async def test() -> None:
        lazy = spawned("lazy", start="on_demand", wake_timeout=30)
        lazy.stop()
        waking = Waking(BackendPool([lazy]))
        waiting = asyncio.create_task(waking("m", 30))
        await asyncio.sleep(0.1)
        lazy.fail()  # its start crashed too often: it will not come
        await asyncio.wait_for(waiting, 1)  # the 503 now, not after 30 s
    asyncio.run(test())


def test_an_instance_back_from_a_restart_starts_its_idle_time_again() -> None:
    async def test() -> None:
        crashy = spawned("crashy", stop_after=60)
        crashy.mark_ready()
        d, supervisors, clock, _ = demand(crashy)
        d.look()  # idle from 0
        clock.now = 50
        crashy.start_over()  # crashed; its supervisor starts it again
        d.look()
        clock.now = 140
        crashy.mark_ready()
        d.look()
        clock.now = 141
        d.look()
        assert supervisors["crashy"].stopped == 0  # 1 s idle, not 141
    asyncio.run(test())


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_idle_instance_sleeps_and_a_request_wakes_it_by_its_levels_sequence() -> None:
    async def test() -> None:
        sleepy = spawned("s", sleep_after=10, sleep_level=2)
        sleepy.mark_ready()
        sleepy.pid = 7
        sleeper = FakeSleeper("first", "first")
        d, _, clock, asked = demand(sleepy, sleeper=sleeper)
        d.look()  # first seen ready: its answer is recorded
        await settled()
        clock.now = 11
        d.look()
        await settled()
        assert sleepy.state is BackendState.ASLEEP and sleepy.sleep_level == 2
        asked.add("m")
        d.look()
        await settled()
        assert sleepy.state is BackendState.READY and sleepy.sleep_level is None
        assert sleeper.calls == [("sleep", 2), ("wake", 2)]
        counts = d.counts()
        assert counts["checks"] == [["s", "ok", 1]]
        assert [m[1:3] for m in counts["transitions"]] == [
            ["asleep", "waking"], ["draining", "asleep"], ["ready", "draining"],
            ["verifying", "ready"], ["waking", "verifying"]]
        assert all(n >= 0 for *_, n, _ in counts["seconds"])
    asyncio.run(test())


def test_a_wake_whose_answer_differs_restarts_the_instance_cold() -> None:
    async def test() -> None:
        sleepy = spawned("s", sleep_after=10)
        sleepy.mark_ready()
        sleepy.pid = 7
        d, supervisors, clock, asked = demand(sleepy, sleeper=FakeSleeper("first", "garbled"))
        d.look()
        await settled()
        clock.now = 11
        d.look()
        await settled()
        asked.add("m")
        d.look()
        await settled()
        assert supervisors["s"].restarted == 1 and sleepy.state is BackendState.STARTING
        assert d.counts()["checks"] == [["s", "wrong_answer", 1]] and d.cold_restarts == 1
    asyncio.run(test())


def test_a_wake_that_would_not_fit_puts_the_least_recently_used_instance_to_sleep_first(
        ) -> None:
    async def test() -> None:
        def on_gpu(name: str, model: str) -> Backend:
            b = spawned(name, model=model, sleep_after=100, gpus=[0],
                        args=["--gpu-memory-utilization", "0.45"])
            b.mark_ready()
            return b

        a, b, c = on_gpu("a", "ma"), on_gpu("b", "mb"), on_gpu("c", "mc")
        sleeper = FakeSleeper("a", "b", "c", "c")
        d, _, clock, asked = demand(a, b, c, sleeper=sleeper)
        d.look()  # their first answers
        await settled()
        c.fall_asleep(1)  # c sleeps; a and b hold 72 of 80 GB
        a.load = LoadReport(gpus=(GpuReading(0, 72 << 30, 80 << 30, 40),))
        clock.now = 50
        b.uses += 1  # b was used since: a is the least recently used
        d.look()
        asked.add("mc")
        d.look()
        await settled()
        assert a.state is BackendState.ASLEEP and b.state is BackendState.READY
        assert c.state is BackendState.READY
        assert sleeper.calls == [("sleep", 1), ("wake", 1)]
    asyncio.run(test())


def test_a_wake_that_raises_restarts_the_instance_cold_instead_of_leaving_it_waking() -> None:
    class Broken(FakeSleeper):
        async def wake(self, backend: Backend, level: int) -> bool:
            raise RuntimeError("vLLM's answer was not JSON")

    async def test() -> None:
        sleepy = spawned("s", sleep_after=10)
        sleepy.fall_asleep(1)
        d, supervisors, _, _ = demand(sleepy, sleeper=Broken(), wanted={"m"})
        d.look()
        await settled()
        assert supervisors["s"].restarted == 1 and sleepy.state is BackendState.STARTING
        assert d.counts()["checks"] == [["s", "failed", 1]]
    asyncio.run(test())


def test_a_sleep_whose_answer_is_lost_is_settled_by_asking_vllm() -> None:
    class Unclear(FakeSleeper):
        def __init__(self, asleep: bool | None) -> None:
            super().__init__("first")
            self.asleep = asleep

        async def sleep(self, backend: Backend, level: int) -> bool:
            return False  # a timeout, say: vLLM may sleep or not

        async def sleeping(self, backend: Backend) -> bool | None:
            return self.asleep

    async def test(asleep: bool | None, then: BackendState, restarts: int) -> None:
        sleepy = spawned("s", sleep_after=10)
        sleepy.mark_ready()
        d, supervisors, clock, _ = demand(sleepy, sleeper=Unclear(asleep))
        d.look()
        clock.now = 11
        d.look()
        await settled()
        assert sleepy.state is then
        assert getattr(supervisors["s"], "restarted", 0) == restarts

    asyncio.run(test(True, BackendState.ASLEEP, 0))  # it sleeps after all
    asyncio.run(test(False, BackendState.READY, 0))  # it stayed awake: back in rotation
    asyncio.run(test(None, BackendState.STARTING, 1))  # nobody knows: restarted cold


def test_one_instance_at_a_time_starts_or_wakes_on_a_gpu() -> None:
    async def test() -> None:
        a = spawned("a", model="ma", sleep_after=10, gpus=[0])
        b = spawned("b", model="mb", start="on_demand", gpus=[0])
        a.fall_asleep(1)
        b.stop()
        d, supervisors, _, _ = demand(a, b, sleeper=FakeSleeper(), wanted={"ma", "mb"})
        d.look()
        assert supervisors["b"].started == 0  # a is being woken
        await settled()
        assert a.state is BackendState.READY  # its wake unchecked: no answer was recorded
        d.look()
        assert supervisors["b"].started == 1  # then b, once a is up
        assert d.counts()["checks"] == [["a", "unchecked", 1]]
    asyncio.run(test())


def test_an_idle_stop_is_called_off_when_a_request_comes_during_its_drain() -> None:
    class AskedMeanwhile(FakeSupervisor):
        async def drained(self) -> bool:
            self.backend.drain()
            asked.add("m")  # a request came while it drained: it waits for "m"
            return True

    async def test() -> None:
        d.look()
        clock.now = 31
        d.look()
        await settled()
        assert idle.state is BackendState.READY and supervisor.stopped == 0 and d.stops == 0
        assert supervisor.started == 0  # no cold start either
        asked.clear()
        clock.now = 40
        d.look()
        await settled()
        assert idle.state is BackendState.READY  # its idle time began again at 31

    idle = spawned("idle", stop_after=30)
    idle.mark_ready()
    d, _, clock, asked = demand(idle)
    supervisor = AskedMeanwhile(idle)
    d._supervisors = {"idle": supervisor}  # type: ignore[dict-item]
    asyncio.run(test())


def test_an_idle_sleep_is_called_off_when_a_request_comes_during_its_drain() -> None:
    class AskedMeanwhile(FakeSupervisor):
        async def drained(self) -> bool:
            self.backend.drain()
            asked.add("m")
            return True

    async def test() -> None:
        d.look()
        clock.now = 11
        d.look()
        await settled()
        assert sleepy.state is BackendState.READY and sleeper.calls == []

    sleepy = spawned("s", sleep_after=10)
    sleepy.mark_ready()
    sleeper = FakeSleeper("first")
    d, _, clock, asked = demand(sleepy, sleeper=sleeper)
    d._supervisors = {"s": AskedMeanwhile(sleepy)}  # type: ignore[dict-item]
    asyncio.run(test())


def test_with_sequential_start_one_instance_starts_at_a_time_whatever_its_gpus() -> None:
    async def test() -> None:
        a = spawned("a", model="ma", start="on_demand")
        b = spawned("b", model="mb", start="on_demand")
        a.stop()
        b.stop()
        d, _, _, _ = demand(a, b, wanted={"ma", "mb"})
        supervisors = {n: FakeSupervisor(x, sequential=True) for n, x in (("a", a), ("b", b))}
        d._supervisors = supervisors  # type: ignore[assignment]
        d.look()
        assert [s.started for s in supervisors.values()] == [1, 0]  # a starting: b waits
        a.mark_ready()
        d.look()
        assert [s.started for s in supervisors.values()] == [1, 1]
    asyncio.run(test())


def test_an_unhealthy_instance_does_not_keep_its_models_stopped_sibling_down() -> None:
    async def test() -> None:
        sick, lazy = spawned("sick"), spawned("lazy", start="on_demand")
        sick.mark_ready()
        sick.mark_lost()  # its process ended; its supervisor has yet to restart it
        lazy.stop()
        d, supervisors, _, _ = demand(sick, lazy, wanted={"m"})
        d.look()
        assert supervisors["lazy"].started == 1
    asyncio.run(test())


def test_an_asleep_instance_stopped_for_idleness_is_not_called_back_awake() -> None:
    class AskedMeanwhile(FakeSupervisor):
        async def drained(self) -> bool:
            self.backend.drain()
            asked.add("m")  # its model asked for while it drained: vLLM is still asleep
            return True

    async def test() -> None:
        d.look()
        clock.now = 31
        d.look()
        await settled()
        assert sleepy.state is BackendState.STOPPED and supervisor.stopped == 1

    sleepy = spawned("s", sleep_after=10, stop_after=30)
    sleepy.fall_asleep(2)
    d, _, clock, asked = demand(sleepy, sleeper=FakeSleeper())
    supervisor = AskedMeanwhile(sleepy)
    d._supervisors = {"s": supervisor}  # type: ignore[dict-item]
    asyncio.run(test())


def test_a_lora_adapter_wants_its_bases_on_demand_instances() -> None:
    from gateway.config.adapters import AdapterSpec
    from gateway.routing.adapters import Adapters

    lazy = spawned("lazy", start="on_demand", lora={"max_loras": 1})
    other = spawned("other", model="n", start="on_demand")
    pool = BackendPool([lazy, other], adapters=Adapters(
        [AdapterSpec(name="a1", base="m", path="/srv/a1")]))
    assert pool.demanded("a1") == [lazy] and pool.demanded("m") == [lazy]
    lazy.stop()
    assert Waking(pool).within("a1") == 180  # a request for the adapter waits for its base
