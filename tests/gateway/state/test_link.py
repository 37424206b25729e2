"""The Redis link's automatic pipelining, against a real valkey-server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.metrics import Metrics
from gateway.routing.pins import PinStore
from gateway.state.link import RedisLink
from tests.helpers import RedisServer
from tests.memlink import claim


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    yield s
    s.stop()


class Claims:
    """Pins claimed as one command pair each (SET NX GET and PEXPIRE): what these tests
    batch."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link

    async def claim(self, session: str, backend: str) -> tuple[bool, str | None]:
        return await claim(self._link, f"t:pin:{session}", backend, 60_000)


def client_for(server: RedisServer) -> aioredis.Redis:
    # As the app builds it: redis-py's own pool (100 connections), no retries.
    return aioredis.from_url(server.url, decode_responses=True, socket_timeout=0.5)


def batches(metrics: Metrics) -> float:
    return sum(s.value for s in metrics.redis_latency.collect()[0].samples
               if s.name.endswith("_count"))


def test_a_burst_of_2048_pin_claims_shares_a_few_round_trips(server: RedisServer) -> None:
    """Each claim in its own task, all at once, as a burst of requests makes them: without
    pipelining each takes a pooled connection and the 101st fails (MaxConnectionsError)."""
    metrics = Metrics()

    async def main() -> tuple[list[tuple[bool, str | None]], int]:
        link = RedisLink(client_for(server), "t:", 1.0, metrics, timeout=2.0)
        store = Claims(link)
        results = await asyncio.gather(*(store.claim(f"s{i}", "b0") for i in range(2048)))
        clients = int((await link.client.info("clients"))["connected_clients"])
        await link.aclose()
        return results, clients

    results, clients = asyncio.run(main())
    assert results == [(True, None)] * 2048
    assert metrics.redis_errors._value.get() == 0
    assert batches(metrics) <= 8  # one pipeline per loop turn, at most 4 in flight
    assert clients <= 5  # the batches' connections and the INFO call's own
    assert server.client().dbsize() == 2048


def test_each_caller_gets_its_own_results(server: RedisServer) -> None:
    async def main() -> list[tuple[bool, str | None]]:
        link = RedisLink(client_for(server), "t:", 1.0, Metrics())
        store = Claims(link)
        await asyncio.gather(*(store.claim(f"s{i}", f"b{i}") for i in range(50)))
        again = await asyncio.gather(*(store.claim(f"s{i}", "other") for i in range(50)))
        await link.aclose()
        return again

    assert asyncio.run(main()) == [(True, f"b{i}") for i in range(50)]


def test_reading_a_pin_refreshes_its_ttl(server: RedisServer) -> None:
    async def main() -> None:
        link = RedisLink(client_for(server), "t:", 1.0, Metrics())
        await link.client.set("t:pin:s", "b1", px=1000)
        assert await link.execute(PinStore(link, 600).read("s")) == (True, ["b1"])
        assert await link.client.pttl("t:pin:s") > 500_000
        await link.aclose()

    asyncio.run(main())


def test_a_hung_redis_costs_each_caller_at_most_the_timeout(server: RedisServer) -> None:
    """SIGSTOP: the connection stays open and nothing answers (not a refused connection)."""
    metrics = Metrics()

    async def main() -> tuple[list[tuple[bool, str | None]], float, tuple[bool, str | None]]:
        link = RedisLink(client_for(server), "t:", 0.2, metrics, timeout=0.2)
        store = Claims(link)
        assert await store.claim("warm", "b0") == (True, None)
        assert server.popen is not None
        os.kill(server.popen.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            hung = await asyncio.gather(*(store.claim(f"s{i}", "b0") for i in range(100)))
            took = time.monotonic() - began
        finally:
            os.kill(server.popen.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:  # retry_interval passes, then the link tries again and recovers
            after = await store.claim("later", "b1")
            if after[0] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        await link.aclose()
        return hung, took, after

    hung, took, after = asyncio.run(main())
    assert hung == [(False, None)] * 100
    assert took < 2.0  # 0.2 s timeout; generous for a loaded machine, far below "forever"
    assert metrics.redis_errors._value.get() >= 1
    assert after == (True, None)
    assert metrics.redis_up._value.get() == 1


def test_a_patient_call_asks_while_the_link_counts_as_down_and_brings_it_back(
        server: RedisServer) -> None:
    """One late answer (a stopped server) marks the link down for ``retry_interval``: the
    hot path answers without Redis meanwhile, but a patient caller (the batch store, a
    stored response's retrieval) still asks, and its answer brings the link back up."""
    metrics = Metrics()

    async def main() -> list[tuple[bool, list[object]]]:
        link = RedisLink(client_for(server), "t:", 3600, metrics, timeout=0.2)
        assert await link.execute(("SET", "t:k", "v")) == (True, ["OK"])
        assert server.popen is not None
        os.kill(server.popen.pid, signal.SIGSTOP)
        try:
            late = await link.execute(("GET", "t:k"))
        finally:
            os.kill(server.popen.pid, signal.SIGCONT)
        seen = [late, await link.execute(("GET", "t:k")),
                await link.execute(("GET", "t:k"), patient=True),
                await link.execute(("GET", "t:k"))]
        await link.aclose()
        return seen

    late, hasty, patient, after = asyncio.run(main())
    assert late == (False, []) and hasty == (False, [])
    assert patient == (True, ["v"]) and after == (True, ["v"])
    assert metrics.redis_up._value.get() == 1


def test_a_busy_event_loop_is_not_mistaken_for_a_slow_redis(server: RedisServer) -> None:
    """The loop is blocked for 3x the timeout while a claim waits for its answer (as when a
    burst of requests is being parsed): the answer is in the socket, unread. Counting that
    as a Redis failure would send every session of the burst to consistent hashing."""
    metrics = Metrics()

    async def main() -> list[tuple[bool, str | None]]:
        link = RedisLink(client_for(server), "t:", 1.0, metrics, timeout=0.1)
        store = Claims(link)
        assert await store.claim("warm", "b0") == (True, None)  # connected
        claims = [asyncio.ensure_future(store.claim(f"s{i}", "b0")) for i in range(10)]
        while not link._in_flight:  # the batch is on its way ...  # noqa: ASYNC110
            await asyncio.sleep(0)
        await asyncio.sleep(0.02)  # ... sent, and answered into the socket
        time.sleep(0.3)  # the loop is busy elsewhere  # noqa: ASYNC251
        results = await asyncio.gather(*claims)
        await link.aclose()
        return results

    assert asyncio.run(main()) == [(True, None)] * 10
    assert metrics.redis_errors._value.get() == 0
    assert metrics.redis_up._value.get() == 1


def test_a_loop_kept_busy_is_not_mistaken_for_a_slow_redis(server: RedisServer) -> None:
    """Every loop turn takes 20 ms (a burst being parsed) while the answer is late (Redis
    shares the busy core: here it is stopped for 0.3 s). Timers still fire on time, so only
    the length of the turns tells the loop's lag from Redis's."""
    metrics = Metrics()

    async def main() -> tuple[bool, str | None]:
        link = RedisLink(client_for(server), "t:", 1.0, metrics, timeout=0.1)
        store = Claims(link)
        assert await store.claim("warm", "b0") == (True, None)
        busy = True

        async def burst() -> None:
            while busy:
                time.sleep(0.02)  # noqa: ASYNC251
                await asyncio.sleep(0)

        hog = asyncio.ensure_future(burst())
        assert server.popen is not None
        os.kill(server.popen.pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(
            0.3, os.kill, server.popen.pid, signal.SIGCONT)
        try:
            return await store.claim("s", "b0")
        finally:
            busy = False
            await hog
            await link.aclose()

    assert asyncio.run(main()) == (True, None)
    assert metrics.redis_errors._value.get() == 0
