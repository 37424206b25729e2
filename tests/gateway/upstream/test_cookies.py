"""The upstream client is shared by every client of the gateway, so it must keep no state
between requests: a cookie one backend answer sets must never ride on another request."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.config import UpstreamSection
from gateway.upstream import make_upstream


async def _exchange(client: str) -> tuple[list[bytes], list[str | None]]:
    """Two requests through one upstream client to a backend that sets a cookie.

    Returns the Set-Cookie values the first answer carried and the Cookie header the
    backend saw on each request."""
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        resp = web.Response(text="ok")
        resp.set_cookie("AWSALB", "node-7", path="/")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # one socket, so one port
    await site.start()
    port = runner.addresses[0][1]
    upstream = make_upstream(UpstreamSection(client=client))
    # A host name, not an IP: aiohttp's default jar ignores cookies from IP addresses only.
    url = f"http://localhost:{port}/v1/chat/completions"
    set_cookie: list[bytes] = []
    try:
        for _ in range(2):
            resp = await upstream.request("POST", url, [], b"{}")
            set_cookie = set_cookie or [v for k, v in resp.headers if k.lower() == b"set-cookie"]
            while await resp.read():
                pass
            await resp.aclose(reuse=True)
    finally:
        await upstream.aclose()
        await runner.cleanup()
    return set_cookie, seen


@pytest.mark.parametrize("client", ["httptools", "aiohttp", "httpx"])
def test_backend_cookies_pass_to_the_client_and_are_never_replayed(client: str) -> None:
    set_cookie, seen = asyncio.run(_exchange(client))
    assert set_cookie and set_cookie[0].startswith(b"AWSALB=node-7")  # passed through
    assert seen == [None, None]  # the second request carried no cookie of the first's answer
