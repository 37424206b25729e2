"""The proxy alone (issue 37): the real request path built by ``gateway.build`` from a
config, against in-memory backends (``tests.fakes``), no sockets, no processes, no Redis.
Each test names the row of the decision table or the queue's rule it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway.build import Parts, build
from tests.factories import config
from tests.fakes import Answered, FakeUpstream, Reply, always, call, completion, held
from tests.memlink import MemoryLink, built_with

A, B = "http://a.test:8000", "http://b.test:8000"
NO_REDIS = {"routing": {"sticky": False}, "breaker": {"share": False},
            "degraded": {"cache": False}}
BODY = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def gateway(upstream: FakeUpstream, *backends: dict[str, Any],
            **sections: Any) -> Parts:
    """The gateway's parts with these backends, each ready and serving model ``m``."""
    specs = list(backends) or [{"name": "a", "url": A}, {"name": "b", "url": B}]
    parts = build(config(backends=specs, **{**NO_REDIS, **sections}), upstream=upstream)
    for backend in parts.pool.backends:
        backend.mark_ready()
        backend.learn(frozenset({"m"}), None)
    return parts


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, 10))


def test_a_5xx_is_retried_on_the_other_backend(loop: asyncio.AbstractEventLoop) -> None:
    upstream = FakeUpstream({A: always(Reply.json(500, {"error": "boom"})),
                             B: always(completion("from b"))})
    parts = gateway(upstream, routing={"sticky": False, "policy": "round_robin"})
    answered = run(loop, call(parts.proxy, BODY))
    assert answered.status == 200
    assert answered.json()["choices"][0]["message"]["content"] == "from b"
    assert answered.headers["x-gateway-backend"] == "b"
    assert [url for url, _ in upstream.sent] == [A + "/v1/chat/completions",
                                                 B + "/v1/chat/completions"]


def test_a_4xx_is_the_clients_passed_through_verbatim_and_tried_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    refusal = Reply.json(400, {"error": {"message": "too long", "type": "BadRequestError",
                                         "code": 400}})
    upstream = FakeUpstream({A: always(refusal), B: always(refusal)})
    parts = gateway(upstream)
    answered = run(loop, call(parts.proxy, BODY))
    assert answered.status == 400 and answered.body == refusal.chunks[0]
    assert len(upstream.sent) == 1
    assert parts.breakers.allows(parts.pool.backends[0])


def test_a_refused_connection_moves_on_and_none_left_is_a_503(
    loop: asyncio.AbstractEventLoop,
) -> None:
    upstream = FakeUpstream({B: always(completion("b"))})  # a.test refuses connections
    parts = gateway(upstream)
    for _ in range(4):
        assert run(loop, call(parts.proxy, BODY)).headers["x-gateway-backend"] == "b"
    upstream.backends.clear()
    answered = run(loop, call(parts.proxy, BODY))
    assert answered.status == 503 and "retry-after" in answered.headers
    assert answered.json()["error"]["type"] == "service_unavailable"
    assert "a.test" not in answered.body.decode()  # no backend URL reaches a client


def test_an_unknown_model_is_404_and_reaches_no_backend(
    loop: asyncio.AbstractEventLoop,
) -> None:
    upstream = FakeUpstream({A: always(completion()), B: always(completion())})
    answered = run(loop, call(gateway(upstream).proxy, {**BODY, "model": "nope"}))
    assert answered.status == 404 and answered.json()["error"]["code"] == "model_not_found"
    assert upstream.sent == []


def waiting(parts: Parts) -> float:
    """Requests held in the gateway's queue, as its metric says."""
    return sum(s.value for s in parts.metrics.queue_depth.collect()[0].samples)


def test_a_full_backend_queues_and_each_freed_place_goes_in_turn(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """One backend of one place: requests wait in the gateway's queue and go in order."""
    release = asyncio.Event()
    upstream = FakeUpstream({A: held(completion(), release)})
    parts = gateway(upstream, {"name": "a", "url": A, "max_concurrent": 1})
    done: list[int] = []

    async def one(n: int) -> None:
        await call(parts.proxy, {**BODY, "messages": [{"role": "user", "content": str(n)}]})
        done.append(n)

    async def scenario() -> None:
        tasks = []
        for n in range(3):
            tasks.append(asyncio.create_task(one(n)))
            await _until(lambda n=n: len(upstream.sent) == 1 and waiting(parts) == n)
        release.set()
        await asyncio.gather(*tasks)

    run(loop, scenario())
    assert done == [0, 1, 2]
    assert [orjson.loads(body)["messages"][0]["content"] for _, body in upstream.sent] == [
        "0", "1", "2"]


def test_a_place_freed_by_a_retry_wakes_the_queue_at_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """X's backend fails it (X moves on to wait for the other), Y is queued: the place X's
    attempt freed goes to Y while X and Z are still running."""
    fail_x, release_z = asyncio.Event(), asyncio.Event()

    async def backend(body: bytes) -> Reply:
        if b'"x"' in body:
            await fail_x.wait()
            return Reply.json(500, {"error": "boom"})
        if b'"z"' in body:
            await release_z.wait()
        return completion()

    upstream = FakeUpstream({A: backend, B: backend})
    parts = gateway(upstream, {"name": "a", "url": A, "max_concurrent": 1},
                    {"name": "b", "url": B, "max_concurrent": 1})
    done: list[str] = []

    async def ask(said: str) -> None:
        answered = await call(parts.proxy,
                              {**BODY, "messages": [{"role": "user", "content": said}]})
        done.append(f"{said}:{answered.status}")

    async def scenario() -> None:
        x = asyncio.create_task(ask("x"))
        await _until(lambda: len(upstream.sent) == 1)
        z = asyncio.create_task(ask("z"))
        await _until(lambda: len(upstream.sent) == 2)
        y = asyncio.create_task(ask("y"))
        await _until(lambda: waiting(parts) == 1)
        fail_x.set()
        await _until(lambda: "y:200" in done)
        assert done == ["y:200"]  # X waits for Z's backend; Z still runs
        release_z.set()
        await asyncio.gather(x, y, z)

    run(loop, scenario())


async def _until(condition: Any, within: float = 5.0) -> None:
    """Let the loop run until ``condition()`` holds (the proxy's own tasks move it)."""
    end = asyncio.get_running_loop().time() + within
    while not condition():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not met")
        await asyncio.sleep(0)


class HeldLink(MemoryLink):
    """A Redis that answers only once ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.waiting = 0

    async def execute(self, *commands: Any, patient: bool = False) -> tuple[bool, list[Any]]:
        self.waiting += 1
        await self.answer.wait()
        self.waiting -= 1
        return await super().execute(*commands, patient=patient)


def sessions(parts: Parts, result: str) -> float:
    return parts.metrics.sticky.labels(result)._value.get()  # type: ignore[no-any-return]


@pytest.mark.parametrize("backends", [1, 2])
def test_a_session_waits_for_its_pin_only_when_there_is_a_choice(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch, backends: int,
) -> None:
    """With one backend that can take it, a session's request is not held behind a Redis
    round trip (in a burst, behind every request without a session); it is pinned there
    off its path. With two, its pin is read (claimed) before it goes."""
    link = HeldLink()
    built_with(link, monkeypatch)
    upstream = FakeUpstream({A: always(completion("from a")), B: always(completion("b"))})
    specs = [{"name": "a", "url": A}, {"name": "b", "url": B}][:backends]
    parts = gateway(upstream, *specs, routing={"sticky": True},
                    redis={"url": "redis://127.0.0.1:1"})
    session = [(b"x-session-id", b"s1")]

    async def scenario() -> Answered:
        asking = asyncio.create_task(call(parts.proxy, BODY, headers=session))
        await _until(lambda: asking.done() or link.waiting > 0)
        if backends == 1:
            answered = await asking
            assert not link.answer.is_set()  # answered while Redis had not: not waited for
        else:
            assert not upstream.sent  # held until Redis answers
            link.answer.set()
            answered = await asking
        link.answer.set()
        await link.settled()
        return answered

    answered = run(loop, scenario())
    assert answered.status == 200
    pinned = link.run("GET", link.prefix + "pin:m:s1")
    assert pinned == answered.headers["x-gateway-backend"]
    assert sessions(parts, "sole" if backends == 1 else "miss") == 1
    again = run(loop, call(parts.proxy, BODY, headers=session))
    run(loop, link.settled())
    assert again.headers["x-gateway-backend"] == pinned
    assert parts.router.pins_made == {pinned: 1}  # one session, however it was pinned


@pytest.mark.parametrize("redis", ["away", "back without the records"])
def test_follow_ups_reach_their_responses_backend_while_redis_cannot_say(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch, redis: str,
) -> None:
    """A stored response's follow-ups and retrievals go to the backend that stored it even
    when Redis did not take the record (away when the first turns were answered) or cannot
    be asked: the process remembers the responses it made. Round robin would send every
    second request to the other backend (the CI failure of stop 43: 19 of 20 follow-ups
    answered 404 by the instance that never stored them)."""
    link = MemoryLink()
    built_with(link, monkeypatch)
    stored = Reply.json(200, {"object": "response", "status": "completed"})
    upstream = FakeUpstream({A: always(stored), B: always(stored)})
    parts = gateway(upstream, routing={"policy": "round_robin"},
                    redis={"url": "redis://127.0.0.1:1"})
    first = {"model": "m", "input": "hello", "store": True}
    link.down = True
    made = []
    for _ in range(3):  # a, b, a: round robin alone would send the follow-ups to b, a, b
        answered = run(loop, call(parts.proxy, first, path="/v1/responses"))
        assert answered.status == 200
        made.append((orjson.loads(upstream.sent[-1][1])["request_id"],
                     answered.headers["x-gateway-backend"]))
    assert {backend for _, backend in made} == {"a", "b"}  # round robin, as expected
    link.down = redis == "away"
    for rid, backend in made:
        follow = {**first, "input": "go on", "previous_response_id": rid}
        answered = run(loop, call(parts.proxy, follow, path="/v1/responses"))
        assert (answered.status, answered.headers["x-gateway-backend"]) == (200, backend)
    # Redis never held the first turns' records: the process's memory answered.
    assert not any(link.store.exists(link.prefix + "resp:" + rid) for rid, _ in made)
