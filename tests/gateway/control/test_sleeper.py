"""The check after a wake asks the instance's base model, never an adapter it lists: the
adapters an instance lists change between the check before its first sleep and the one
after a wake, and an adapter's answer is not the base's."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.control.sleep import Sleeper
from tests.factories import backend


async def _asked(models: tuple[str, ...], **spec: object) -> list[str]:
    """The models a check asked a server listing ``models`` for (one card each: "a01" an
    adapter of "base")."""
    asked: list[str] = []

    async def completions(request: web.Request) -> web.Response:
        asked.append((await request.json())["model"])
        return web.json_response({"choices": [{"text": " jumps"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if "spawn" in spec:
        b = backend("v1", ready=True, models=models,
                    spawn={"model": "/m", "port": port, **spec["spawn"]})  # type: ignore[dict-item]
    else:
        b = backend("v1", f"http://127.0.0.1:{port}", ready=True, models=models)
    b.cards = {m: {"id": m, "parent": "base" if m == "a01" else None} for m in models}
    sleeper = Sleeper(timeout=5)
    try:
        assert await sleeper.answer(b) == " jumps"
    finally:
        await sleeper.aclose()
        await runner.cleanup()
    return asked


def test_the_check_asks_the_base_model_not_an_adapter_listed_beside_it() -> None:
    """"a01" sorts first: it was asked before."""
    assert asyncio.run(_asked(("base", "a01"), spawn={"served_model_name": "base"})) == ["base"]
    assert asyncio.run(_asked(("base", "a01"))) == ["base"]  # a url backend: by its cards


def test_the_check_asks_what_the_instance_lists_when_its_served_name_is_not_listed() -> None:
    """A spawn whose command or args name the served model otherwise: the base it lists."""
    assert asyncio.run(_asked(("other", "a01"), spawn={"served_model_name": "base"})) == ["other"]
