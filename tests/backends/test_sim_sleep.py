"""The simulator's sleep mode in vLLM 0.32's shapes (``backends/sim/sleep.py`` names the
vLLM sources): its dev routes, a paused scheduler that holds requests until the wake,
the prefix cache dropped, and wrong answers after a level-2 wake without a weight reload
or with the ``wake_garbles`` fault."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from backends.sim.app import SimApp
from backends.sim.options import SimOptions

CHAT = {"model": "sim-model", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "the same question " * 8}]}
Test = Callable[[httpx.AsyncClient, SimApp], Awaitable[None]]


def run(test: Test, **options: Any) -> None:
    app = SimApp(SimOptions(**{"dev_mode": True, "sleep_mode": True, "token_details": True,
                               **options}))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            await asyncio.wait_for(test(client, app), 10)
    asyncio.run(main())


async def answer(client: httpx.AsyncClient) -> str:
    reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200
    return str(reply.json()["choices"][0]["message"]["content"])


def sleep_state(text: str) -> dict[str, int]:
    return {line.split('sleep_state="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vllm:engine_sleep_state{")}


def test_level_1_holds_requests_until_the_wake_and_drops_the_prefix_cache() -> None:
    async def test(client: httpx.AsyncClient, app: SimApp) -> None:
        before = await answer(client)
        slept = await client.post("/sleep", params={"level": 1})
        assert (slept.status_code, slept.json()) == (200, {"status": "sleeping", "level": 1})
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert sleep_state((await client.get("/metrics")).text) == {
            "awake": 0, "weights_offloaded": 1, "discard_all": 0}
        waiting = asyncio.create_task(answer(client))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # taken, not scheduled
        woke = await client.post("/wake_up")
        assert woke.json() == {"status": "awake", "tags": None}
        assert await waiting == before  # level 1 keeps the weights: the same answer
        reply = (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # cached again
        assert app.prefix.hits > 0 and app.sleep.wakes == 1
    run(test)


def test_level_2_answers_wrong_until_the_weights_are_reloaded() -> None:
    async def test(client: httpx.AsyncClient, app: SimApp) -> None:
        before = await answer(client)
        await client.post("/sleep", params={"level": 2})
        assert sleep_state((await client.get("/metrics")).text)["discard_all"] == 1
        await client.post("/wake_up")
        assert await answer(client) != before  # vllm#29341: woken without a reload
        await client.post("/sleep", params={"level": 2})
        partial = await client.post("/wake_up", params={"tags": "weights"})
        assert partial.json() == {"status": "sleeping", "tags": ["weights"]}
        reload = await client.post("/collective_rpc", json={"method": "reload_weights"})
        assert reload.json() == {"results": [None]}
        woke = await client.post("/wake_up", params={"tags": "kv_cache"})
        assert woke.json()["status"] == "awake"
        assert await answer(client) == before  # the sequence right for level 2
    run(test)


def test_the_wake_fault_makes_every_wake_answer_wrong() -> None:
    async def test(client: httpx.AsyncClient, app: SimApp) -> None:
        before = await answer(client)
        await client.post("/sleep", params={"level": 1})
        await client.post("/wake_up")
        assert await answer(client) != before
    run(test, wake_garbles=True)


def test_bad_parameters_and_a_disabled_sleep_mode_are_refused() -> None:
    async def test(client: httpx.AsyncClient, app: SimApp) -> None:
        bad = await client.post("/sleep", params={"level": 3})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "level"]
        assert (await client.post("/sleep", params={"mode": "nap"})).status_code == 422
        refused = await client.post("/sleep")
        assert refused.status_code == 500 and refused.json()["error"]["code"] == 500
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
    run(test, sleep_mode=False)


def test_without_dev_mode_there_are_no_sleep_routes() -> None:
    async def test(client: httpx.AsyncClient, app: SimApp) -> None:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/collective_rpc")):
            assert (await client.request(method, path)).status_code == 404
    run(test, dev_mode=False)
