"""The in-memory link (``tests.memlink.MemoryLink``) held to the real one: each scenario runs
the same commands against ``RedisLink`` on a real valkey-server and against ``MemoryLink``,
and both must answer alike (and as the scenario expects). Time passes by sleeping for the
real one and by moving the fake's clock; TTLs are compared in ranges."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.config.tenancy import LimitsSection
from gateway.metrics import Metrics
from gateway.routing import pins
from gateway.state.link import RedisLink
from gateway.tenants import limits
from gateway.tenants.keyring import Tenant
from gateway.tenants.limits import Limits
from tests.factories import request
from tests.helpers import RedisServer
from tests.memlink import Clock, MemoryLink, claim

Later = Callable[[float], Awaitable[None]]  # let this many seconds pass
Scenario = Callable[[Any, Later], Awaitable[list[Any]]]
NOW = 1_800_000_000.0 + 7  # seconds since the epoch: 7 s into a minute


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("contract"))
    yield s
    s.stop()


def shown(value: Any) -> Any:
    """A result as compared: an error by its code (the two say it with other classes)."""
    if isinstance(value, Exception):
        return ("error", str(value).split()[0])
    if isinstance(value, list | tuple):
        return type(value)(shown(v) for v in value)
    return value


def on_real(server: RedisServer, scenario: Scenario) -> list[Any]:
    server.client().flushdb()

    async def main() -> list[Any]:
        client = aioredis.from_url(server.url, decode_responses=True, socket_timeout=2)
        link = RedisLink(client, "t:", 1.0, Metrics(), timeout=2.0)
        try:
            return await scenario(link, asyncio.sleep)
        finally:
            await link.aclose()

    result: list[Any] = shown(asyncio.run(asyncio.wait_for(main(), 20)))
    return result


def on_memory(scenario: Scenario) -> list[Any]:
    clock = Clock()
    link = MemoryLink("t:", clock)

    async def later(seconds: float) -> None:
        clock.advance(seconds)

    async def main() -> list[Any]:
        try:
            return await scenario(link, later)
        finally:
            await link.aclose()

    result: list[Any] = shown(asyncio.run(asyncio.wait_for(main(), 20)))
    return result


def alike(server: RedisServer, scenario: Scenario) -> list[Any]:
    real = on_real(server, scenario)
    assert on_memory(scenario) == real
    return real


async def one(link: Any, *command: Any) -> Any:
    answered, results = await link.execute(command)
    assert answered
    return results[0]


def test_strings_and_their_options(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        answered, results = await link.execute(
            ("GET", "t:a"), ("SET", "t:a", "1"), ("GET", "t:a"),
            ("SET", "t:a", "2", "NX", "GET", "PX", 60_000, {"get": True}),
            ("SET", "t:b", "x", "NX", "GET", "PX", 60_000, {"get": True}),
            ("SET", "t:b", "y", "NX", "PX", 60_000), ("SET", "t:c", "z", "NX", "PX", 60_000),
            ("INCR", "t:a"), ("INCRBY", "t:a", 5), ("INCRBY", "t:a", -2), ("INCR", "t:b"),
            ("SET", "t:d", b"bytes \xe2\x9c\x93", "PX", 60_000), ("GET", "t:d"),
            ("SET", "t:e", 12, "PX", 60_000), ("GET", "t:e"),
            ("DEL", "t:a", "t:nothing"), ("GET", "t:a"), ("PEXPIRE", "t:nothing", 100))
        return [answered, results]

    assert alike(server, scenario) == [True, [
        None, "OK", "1", "1", None, None, "OK", 2, 7, 5, ("error", "ERR"),
        "OK", "bytes \u2713", "OK", "12", 1, None, 0]]


def test_wrong_types_answer_an_error_in_their_place(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        _, results = await link.execute(
            ("ZADD", "t:z", 1, "m"), ("GET", "t:z"), ("INCR", "t:z"), ("HINCRBY", "t:z", "f", 1),
            ("SET", "t:s", "v"), ("ZCARD", "t:s"), ("HGETALL", "t:s"), ("GET", "t:s"))
        return list(results)

    assert alike(server, scenario) == [
        1, ("error", "WRONGTYPE"), ("error", "WRONGTYPE"), ("error", "WRONGTYPE"), "OK",
        ("error", "WRONGTYPE"), ("error", "WRONGTYPE"), "v"]


def test_hashes_as_the_ledger_uses_them(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        _, results = await link.execute(
            ("HINCRBY", "t:h", "requests", 1), ("HINCRBY", "t:h", "prompt_tokens", 7),
            ("HINCRBY", "t:h", "requests", 1), ("PEXPIRE", "t:h", 60_000),
            ("HGETALL", "t:h"), ("HGETALL", "t:none"))
        return list(results)

    assert alike(server, scenario) == [1, 7, 2, 1, ["requests", "2", "prompt_tokens", "7"], []]


def test_sorted_sets(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        _, results = await link.execute(
            ("ZADD", "t:z", 100, "a"), ("ZADD", "t:z", 200, "b"), ("ZADD", "t:z", 300, "a"),
            ("ZCARD", "t:z"), ("ZSCORE", "t:z", "a"), ("ZREMRANGEBYSCORE", "t:z", "-inf", 199),
            ("ZCARD", "t:z"), ("ZREMRANGEBYSCORE", "t:z", "(200", "+inf"), ("ZCARD", "t:z"),
            ("ZREM", "t:z", "a", "nope"), ("ZREM", "t:z", "b"), ("ZCARD", "t:z"),
            ("PTTL", "t:z"))
        return list(results)

    assert alike(server, scenario) == [1, 1, 0, 2, "300", 0, 2, 1, 1, 0, 1, 0, -2]


def test_ttls_expire_and_getex_refreshes_them(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        out: list[Any] = []
        await link.execute(("SET", "t:short", "v", "PX", 300), ("SET", "t:kept", "v"),
                           ("SET", "t:ex", "v", "PX", 300))
        out.append(await one(link, "PTTL", "t:kept"))
        out.append(0 < await one(link, "PTTL", "t:short") <= 300)
        await later(0.15)
        out.append(await one(link, "GETEX", "t:ex", "PX", 600))  # refreshed, for longer
        # 0.5 s after: the short one is gone, the refreshed one is not (margins of 0.2 s
        # and 0.25 s: the machine may be busy); at 0.95 s the refreshed one is gone too.
        await later(0.35)
        out += [await one(link, "GET", "t:short"), await one(link, "PTTL", "t:short"),
                await one(link, "GET", "t:ex"), await one(link, "EXISTS", "t:short", "t:ex")]
        await later(0.45)
        out += [await one(link, "GETEX", "t:ex", "PX", 300), await one(link, "GET", "t:kept")]
        out.append(await one(link, "PEXPIRE", "t:kept", 0))  # 0: gone at once
        out.append(await one(link, "GET", "t:kept"))
        return out

    assert alike(server, scenario) == [-1, True, "v", None, -2, "v", 1, None, "v", 1, None]


def test_pins_claimed_read_and_kept(server: RedisServer) -> None:
    """A session's pin as the router keeps it: ``claim`` (SET NX GET and PEXPIRE), read with
    its TTL refreshed (GETEX PX), written off the path (SET [NX] PX)."""
    async def scenario(link: Any, later: Later) -> list[Any]:
        ttl = 400
        out: list[Any] = [await claim(link, "t:pin:s", "b1", ttl),
                          await claim(link, "t:pin:s", "b2", ttl)]
        await later(0.25)
        out.append(await claim(link, "t:pin:s", "b3", ttl))  # refreshed: b1's, 0.25 s later
        await later(0.25)
        out.append(await one(link, "GETEX", "t:pin:s", "PX", ttl))
        out.append(await one(link, "SET", "t:pin:s", "b4", "NX", "PX", ttl))  # has one
        out.append(await one(link, "SET", "t:pin:s", "b4", "PX", ttl))  # over it
        await later(0.25)
        out.append(await one(link, "GETEX", "t:pin:s", "PX", ttl))  # the SET's TTL held
        await later(0.5)  # nobody used it for longer than its TTL
        out += [await one(link, "GETEX", "t:pin:s", "PX", ttl),
                await one(link, "SET", "t:pin:s", "b5", "NX", "PX", ttl),
                await claim(link, "t:pin:s", "b6", ttl), await claim(link, "t:o", "x", 60_000)]
        return out

    assert alike(server, scenario) == [
        (True, None), (True, "b1"), (True, "b1"), "b1", None, "OK", "b4", None, "OK",
        (True, "b5"), (True, None)]


def test_the_pin_claim_script_takes_turns_for_new_sessions_only(server: RedisServer) -> None:
    """``pins.CLAIM``: a session's pin answered (and refreshed), or a new session pinned to
    the next of the candidates in the model's turn order, which pinned sessions never move."""
    async def scenario(link: Any, later: Later) -> list[Any]:
        def claim(session: str, *turns: str) -> tuple[Any, ...]:
            return ("EVAL", pins.CLAIM, 2, f"t:pin:{session}", "t:turn:m", 400, *turns)
        out = [await one(link, *claim("s1", "a", "b")), await one(link, *claim("s1", "a", "b")),
               await one(link, *claim("s2", "a", "b")), await one(link, *claim("s1", "a", "b")),
               await one(link, *claim("s3", "a", "b", "b")), await one(link, *claim("s4")),
               await one(link, "GET", "t:turn:m")]
        await later(0.25)
        out.append(await one(link, *claim("s1", "x")))  # refreshed at each use: still a
        await later(0.5)
        out.append(await one(link, *claim("s1", "x")))  # gone: a new one, and the turn too
        return out

    assert alike(server, scenario) == [
        ["a"], "a", ["b"], "a", ["b"], None, "3", "a", ["x"]]


def script(key: str, rpm: int, tpm: int, est: int, conc: int, member: str, now_ms: int,
           stale: int = 60_000, ttl: int = 120_000) -> tuple[Any, ...]:
    return ("EVAL", limits.SCRIPT, 3, f"{key}:r", f"{key}:t", f"{key}:c", rpm, tpm, est, conc,
            member, now_ms, stale, ttl)


def test_the_limits_script_requests_and_tokens(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        rpm = [await one(link, *script("t:r", 2, 0, 0, 0, f"m{i}", 1000)) for i in range(3)]
        tpm = [await one(link, *script("t:t", 0, 100, est, 0, f"m{i}", 1000))
               for i, est in enumerate((150, 10, 1))]  # the first always goes (used == 0)
        both = await one(link, *script("t:b", 1, 50, 60, 0, "m", 1000))
        _, state = await link.execute(("GET", "t:r:r"), ("GET", "t:t:t"), ("GET", "t:t:r"),
                                      ("PTTL", "t:r:r"), ("PTTL", "t:t:t"))
        return [rpm, tpm, both, state[:3], [115_000 < t <= 120_000 for t in state[3:]]]

    assert alike(server, scenario) == [
        ["ok", "ok", "rpm"], ["ok", "tpm", "tpm"], "ok", ["2", "150", None], [True, True]]


def test_the_limits_script_concurrency_and_stale_members(server: RedisServer) -> None:
    async def scenario(link: Any, later: Later) -> list[Any]:
        out = [await one(link, *script("t:c", 0, 0, 0, 2, m, at, stale=5000))
               for m, at in (("a", 1000), ("b", 2000), ("c", 3000))]
        out.append(await one(link, "ZREM", "t:c:c", "a"))
        out.append(await one(link, *script("t:c", 0, 0, 0, 2, "d", 4000, stale=5000)))
        # At 7,500 "b" (2,000) is older than 5 s: dropped, so "e" finds a place.
        out.append(await one(link, *script("t:c", 0, 0, 0, 2, "e", 7500, stale=5000)))
        out.append(await one(link, *script("t:c", 0, 0, 0, 2, "f", 7500, stale=5000)))
        _, state = await link.execute(("ZCARD", "t:c:c"), ("ZSCORE", "t:c:c", "b"),
                                      ("PTTL", "t:c:c"))
        return [*out, state[0], state[1], 4000 < state[2] <= 5000]

    assert alike(server, scenario) == [
        "ok", "ok", "concurrency", 1, "ok", "ok", "concurrency", 2, None, True]


def test_the_limits_through_limits_admit_and_release(server: RedisServer) -> None:
    """The same admissions and releases, verdict for verdict, on both (the release writes
    go off the request path: waited for before the next look)."""
    tenant = Tenant("t1", rpm=5, tpm=1000, max_concurrent=2)

    async def scenario(link: Any, later: Later) -> list[Any]:
        gate = Limits(link, LimitsSection(), 1, 60.0, Metrics(), clock=lambda: NOW)
        out: list[Any] = []
        held = []
        for i in range(3):
            try:
                held.append(await gate.admit(tenant, request(request_id=f"r{i}", body=b"x" * 400,
                                                             payload={"max_tokens": 100})))
                out.append("ok")
            except Exception as exc:
                out.append(type(exc).__name__)
        assert held[0] is not None
        gate.release(held[0], used=20)  # 200 estimated, 20 used
        await settle(link)
        minute = int(NOW // 60)
        _, state = await link.execute(("GET", f"t:lim:t1:r:{minute}"),
                                      ("GET", f"t:lim:t1:t:{minute}"), ("ZCARD", "t:lim:t1:c"))
        return [out, state]

    assert alike(server, scenario) == [["ok", "ok", "RateLimited"], ["2", "220", 1]]


async def settle(link: Any) -> None:
    """The link's ``soon`` writes done (the real one's: a few loop turns and a round trip)."""
    if isinstance(link, MemoryLink):
        await link.settled()
    else:
        await asyncio.gather(*link._chores)


def test_the_background_loops_client_calls(server: RedisServer) -> None:
    """What breaker and canary sync do through ``call(op)``, with redis-py's answers."""
    async def scenario(link: Any, later: Later) -> list[Any]:
        c = link.client

        async def pipeline() -> Any:
            pipe = c.pipeline(transaction=False)
            pipe.hincrby("t:w", "requests", 3)
            pipe.hincrby("t:w", "errors", 1)
            pipe.expire("t:w", 86400)
            pipe.hgetall("t:w")
            pipe.hgetall("t:none")
            return await pipe.execute()

        return [
            await link.call(lambda: c.set("t:lead", "me", nx=True, px=60_000)),
            await link.call(lambda: c.set("t:lead", "you", nx=True, px=60_000)),
            await link.call(lambda: c.get("t:lead")),
            await link.call(lambda: c.pexpire("t:lead", 60_000)),
            await link.call(lambda: c.pexpire("t:nothing", 60_000)),
            await link.call(lambda: c.set("t:br", "1.5", px=60_000)),
            await link.call(lambda: c.mget(["t:br", "t:none", "t:lead"])),
            await link.call(pipeline),
            await link.call(lambda: c.incr("t:lead")),  # an error: counted as Redis away
        ]

    assert alike(server, scenario) == [
        (True, True), (True, None), (True, "me"), (True, True), (True, False), (True, True),
        (True, ["1.5", None, "me"]),
        (True, [3, 1, True, {"requests": "3", "errors": "1"}, {}]), (False, None)]


def test_redis_away_answers_at_once_unanswered(tmp_path: Path) -> None:
    """The real link with its server gone, and the fake ``down``: the same answers."""
    async def scenario(link: Any, stop: Callable[[], None]) -> list[Any]:
        out: list[Any] = [link.available, link.up, await link.execute(("SET", "t:k", "v"))]
        stop()
        await link.execute(("GET", "t:k"))  # the real link learns it here
        out += [link.available, link.up, await link.execute(("GET", "t:k")),
                await claim(link, "t:k", "w", 1000), await link.call(lambda: link.client.get("k"))]
        return out

    real_server = RedisServer(tmp_path)

    async def real() -> list[Any]:
        client = aioredis.from_url(real_server.url, decode_responses=True, socket_timeout=2)
        link = RedisLink(client, "t:", 30.0, Metrics(), timeout=1.0)
        try:
            return await scenario(link, real_server.stop)
        finally:
            await link.aclose()

    try:
        answers = asyncio.run(asyncio.wait_for(real(), 20))
    finally:
        real_server.stop()
    memory = MemoryLink()

    def down() -> None:
        memory.down = True

    assert asyncio.run(scenario(memory, down)) == answers
    assert answers == [True, True, (True, ["OK"]), False, False, (False, []), (False, None),
                       (False, None)]
