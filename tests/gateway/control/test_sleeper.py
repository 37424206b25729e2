"""The check after a wake asks the instance's base model, never an adapter it lists: the
adapters an instance lists change between the check before its first sleep and the one
after a wake, and an adapter's answer is not the base's."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.control.sleep import Sleeper
from tests.factories import backend


def test_the_check_asks_the_base_model_not_an_adapter_listed_beside_it() -> None:
    asked: list[str] = []

    async def completions(request: web.Request) -> web.Response:
        asked.append((await request.json())["model"])
        return web.json_response({"choices": [{"text": " jumps"}]})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        b = backend("v1", f"http://127.0.0.1:{port}", ready=True, models=("base", "a01"))
        b.cards = {"base": {"id": "base", "parent": None},
                   "a01": {"id": "a01", "parent": "base", "root": "/adapters/a01"}}
        sleeper = Sleeper(timeout=5)
        try:
            assert await sleeper.answer(b) == " jumps"
        finally:
            await sleeper.aclose()
            await runner.cleanup()

    asyncio.run(main())
    assert asked == ["base"]  # "a01" sorts first: it was asked before
