"""The router with a real valkey behind its PinStore."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from backends.backend import Backend
from gateway.config import BreakerSection, RoutingSection
from gateway.metrics import Metrics
from gateway.resilience.breaker import Breakers
from gateway.routing.pins import PinStore
from gateway.routing.policies import make_policy
from gateway.routing.pool import BackendPool
from gateway.routing.router import Router
from gateway.state.link import RedisLink
from gateway.types import Facts, Request
from tests import factories
from tests.helpers import RedisServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("router-redis"))
    yield s
    s.stop()


def backends(n: int) -> list[Backend]:
    return factories.backends(n, ready=True, models={"m"})


def ctx(session: str) -> Request:
    return factories.request(session_key=session)


def run(server: RedisServer, pool: list[Backend], settings: RoutingSection,
        steps: object) -> tuple[list[str], Metrics]:
    async def main() -> list[str]:
        client = aioredis.from_url(server.url, decode_responses=True, socket_timeout=0.5)
        await client.flushall()
        link = RedisLink(client, "t:", 1.0, metrics)
        store = PinStore(link, settings.session_ttl)
        breakers = Breakers(BreakerSection(), [b.name for b in pool])
        router = Router(BackendPool(pool, breakers.allows), make_policy(settings), store,
                        settings, metrics, breakers)
        names = await steps(router, client)  # type: ignore[operator]
        await link.aclose()
        return names  # type: ignore[no-any-return]

    metrics = Metrics()
    return asyncio.run(main()), metrics


async def facts(router: Router, request: Request) -> Facts | None:
    """What the proxy's one round trip tells the router: the session's pin, or the next
    of the candidates the router proposes for a new one."""
    store, (turns, _) = router.store, router.propose(request, None)
    if store is None or turns is None or request.session_key is None:
        return None
    answered, results = await store._link.execute(
        store.claim(request.model, f"{request.model}:{request.session_key}", turns))
    pin, new = store.answer(results[0]) if answered else (None, False)
    return Facts(answered, pin, new)


async def pick(router: Router, request: Request) -> Backend | None:
    ticket = router.choose(request, None, facts=await facts(router, request))
    await router_link_settled(router)
    return None if ticket is None else ticket.backend


async def router_link_settled(router: Router) -> None:
    """The pin written off the request's path has reached Redis."""
    if router.store is not None:
        await router.store._link.settled()


def count(metrics: Metrics, result: str) -> float:
    return metrics.sticky.labels(result)._value.get()


def test_overloaded_pin_is_rebalanced_only_when_the_rule_is_on(server: RedisServer) -> None:
    async def steps(router: Router, client: object) -> list[str]:
        first = await pick(router, ctx("s"))
        assert first is not None
        first.in_flight = 10  # others idle: far above 2x the average
        again = await pick(router, ctx("s"))
        assert again is not None
        return [first.name, again.name]

    pool = backends(3)
    off, _ = run(server, pool, RoutingSection(), steps)
    assert off[0] == off[1]
    for b in pool:
        b.in_flight = 0
    on, metrics = run(server, pool, RoutingSection(session_max_load_factor=2.0), steps)
    assert on[0] != on[1]
    assert count(metrics, "rebalance") == 1


def test_a_flushed_redis_just_means_new_pins(server: RedisServer) -> None:
    async def steps(router: Router, client: aioredis.Redis) -> list[str]:
        first = await pick(router, ctx("f"))
        await client.flushall()
        second = await pick(router, ctx("f"))
        third = await pick(router, ctx("f"))
        return [b.name for b in (first, second, third) if b is not None]

    names, metrics = run(server, backends(3), RoutingSection(), steps)
    assert len(names) == 3 and names[1] == names[2]
    assert count(metrics, "miss") == 2 and count(metrics, "hit") == 1


def test_a_pinned_sessions_requests_take_no_turn_from_new_sessions(
        server: RedisServer) -> None:
    """Two-request conversations, one after another, on two backends: new sessions still
    alternate (a follow-up that took a turn would send every conversation to one)."""
    async def steps(router: Router, client: object) -> list[str]:
        names = []
        for i in range(6):
            first = await pick(router, ctx(f"c{i}"))
            again = await pick(router, ctx(f"c{i}"))
            assert first is not None and again is first
            names.append(first.name)
        return names

    names, metrics = run(server, backends(2), RoutingSection(), steps)
    assert Counter(names) == {"b0": 3, "b1": 3}
    assert count(metrics, "miss") == 6 and count(metrics, "hit") == 6


def test_requests_without_a_session_never_touch_redis(server: RedisServer) -> None:
    async def steps(router: Router, client: aioredis.Redis) -> list[str]:
        plain = factories.request(path="/v1/completions")
        picks = [await pick(router, plain) for _ in range(4)]
        assert await client.dbsize() == 0
        return [b.name for b in picks if b is not None]

    names, _ = run(server, backends(2), RoutingSection(), steps)
    assert sorted(set(names)) == ["b0", "b1"]


def test_outage_store_answers_at_once(tmp_path: Path) -> None:
    dead = RedisServer(tmp_path)
    dead.stop()

    async def steps(router: Router, client: object) -> list[str]:
        picks = [await pick(router, ctx(f"k{i}")) for i in range(5)]
        again = [await pick(router, ctx(f"k{i}")) for i in range(5)]
        assert picks == again  # rendezvous: same session, same backend
        return [b.name for b in picks if b is not None]

    async def main() -> list[str]:
        client = aioredis.from_url(dead.url, decode_responses=True, socket_timeout=0.2,
                                   socket_connect_timeout=0.2)
        settings = RoutingSection()
        store = PinStore(RedisLink(client, "t:", 5.0, metrics), 60)
        breakers = Breakers(BreakerSection(enabled=False), [])
        router = Router(BackendPool(backends(3)), make_policy(settings), store, settings,
                        metrics, breakers)
        return await steps(router, client)

    metrics = Metrics()
    names = asyncio.run(main())
    assert len(names) == 5
    assert metrics.redis_errors._value.get() == 1  # one error, then skipped for 5 s
    assert count(metrics, "fallback") == 10


def test_new_sessions_are_placed_in_turn_not_by_momentary_load(server: RedisServer) -> None:
    """Sessions between turns leave a backend looking idle; least-loaded pinning would pile
    every new session onto it (measured on real vLLM: docs/BENCHMARKS.md)."""
    pool = backends(4)

    async def steps(router: Router, client: object) -> list[str]:
        for b in pool[1:]:
            b.in_flight = 5
        picks = [await pick(router, ctx(f"new-{i}")) for i in range(8)]
        return [b.name for b in picks if b is not None]

    def run_with(pin: str) -> list[str]:
        async def main() -> list[str]:
            client = aioredis.from_url(server.url, decode_responses=True, socket_timeout=0.5)
            await client.flushall()
            link = RedisLink(client, "t:", 1.0, metrics)
            settings = RoutingSection(pin_policy=pin)  # type: ignore[arg-type]
            breakers = Breakers(BreakerSection(), [b.name for b in pool])
            router = Router(BackendPool(pool, breakers.allows), make_policy(settings),
                            PinStore(link, 60), settings, metrics, breakers,
                            make_policy(settings, settings.pin_policy))
            names = await steps(router, client)
            await link.aclose()
            return names

        metrics = Metrics()
        return asyncio.run(main())

    assert sorted(Counter(run_with("round_robin")).values()) == [2, 2, 2, 2]
    assert Counter(run_with("least_loaded")) == {"b0": 8}


def test_room_is_the_share_of_capacity_less_the_reserve_and_vllms_own_saturation() -> None:
    from backends.backend import LoadReport
    from gateway.resilience.breaker import Outcome
    from gateway.routing.queue import NoRoom

    b = factories.backend("b0", ready=True, models={"m"}, max_concurrent=4)
    router = Router(BackendPool([b]), make_policy(RoutingSection()), None, RoutingSection(),
                    Metrics(), Breakers(BreakerSection(), ["b0"]), processes=2)

    def room(in_flight: int, reserve: int = 0, load: LoadReport | None = None) -> bool:
        b.in_flight, b.load = in_flight, load
        try:
            ticket = router.choose(factories.request(), None, (), reserve)
        except NoRoom:
            return False
        assert ticket is not None
        ticket.done(Outcome.NEUTRAL)
        return True

    assert room(1) and not room(2)  # two processes: a share of 2 each
    assert not room(1, reserve=1)  # the last place of the share is reserved
    assert not room(1, load=LoadReport(running=4, waiting=3))  # vLLM queues already
    assert not room(1, load=LoadReport(running=4, kv_usage=0.995))
    assert room(0, load=LoadReport(running=4, waiting=3))  # nothing of ours would wake us
    assert room(1, load=LoadReport(running=2, waiting=1))  # a step's wait, not saturation
    assert room(0) and not room(2, reserve=0)


def test_a_session_waits_a_bounded_time_for_its_pinned_backend_to_free(
        server: RedisServer) -> None:
    from gateway.config.tenancy import QueueSection
    from gateway.resilience.breaker import Outcome
    from gateway.routing.queue import WaitQueue

    pool = [factories.backend(f"b{i}", ready=True, models={"m"}, max_concurrent=1)
            for i in range(2)]

    def steps_with(pin_wait: float, frees: bool) -> object:
        async def steps(router: Router, client: object) -> list[str]:
            queue = WaitQueue(QueueSection(pin_wait=pin_wait), Metrics())
            first = await pick(router, ctx("p"))
            assert first is not None
            first.in_flight = 1  # its one place is taken; the other backend has room
            placing = asyncio.create_task(router.place(ctx("p"), None, [], queue, "t", 0,
                                                       await facts(router, ctx("p"))))
            if frees:
                deadline = asyncio.get_running_loop().time() + 5
                while queue.idle:  # until it waits for its own
                    assert asyncio.get_running_loop().time() < deadline, "never waited"
                    await asyncio.sleep(0.01)
                assert not placing.done()
                first.in_flight = 0
                queue.freed()
            ticket = await asyncio.wait_for(placing, 10)
            assert ticket is not None
            ticket.done(Outcome.NEUTRAL)
            first.in_flight = 0
            return [first.name, ticket.backend.name]

        return steps

    waited, metrics = run(server, pool, RoutingSection(), steps_with(30.0, frees=True))
    assert waited[0] == waited[1] and count(metrics, "hit") == 1  # it freed: it stayed
    moved, metrics = run(server, pool, RoutingSection(), steps_with(0.05, frees=False))
    assert moved[0] != moved[1] and count(metrics, "repin") == 1  # bound passed: moved
    at_once, metrics = run(server, pool, RoutingSection(), steps_with(0.0, frees=False))
    assert at_once[0] != at_once[1]
