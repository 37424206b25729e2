"""The connection cap derived from the descriptor limit (issue 36): every limit gives a cap
that leaves descriptors for the reserve and an upstream connection per client connection,
or a start-up error naming the limit."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from gateway.http import server as server_module
from gateway.http.server import DescriptorLimit, connection_cap, guarded


@pytest.mark.parametrize(("limit", "cap"), [
    (128, 32), (256, 96), (1024, 384), (4096, 1920), (65536, 32640)])
def test_the_derived_cap_leaves_a_reserve_and_an_upstream_descriptor_each(
    limit: int, cap: int,
) -> None:
    assert connection_cap(0, limit) == cap
    assert 2 * cap + 64 <= limit


def test_a_configured_cap_is_kept_below_what_the_limit_allows() -> None:
    assert connection_cap(8, 256) == 8
    assert connection_cap(10_000, 1024) == 384


@pytest.mark.parametrize("limit", [16, 100, 127])
def test_a_limit_too_low_to_serve_names_itself(limit: int) -> None:
    with pytest.raises(DescriptorLimit, match=rf"RLIMIT_NOFILE\) is {limit}: too low"):
        connection_cap(0, limit)


async def _until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 5 s")


async def _serving(cap: int) -> tuple[Any, Any, int, asyncio.Task[None]]:
    """uvicorn in this loop with the front door's protocol and a cap of ``cap``; its app
    answers each request after 0.1 s."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asyncio.sleep(0.1)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol = guarded(10.0, 65536, cap)
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="critical"))
    sock = socket.create_server(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await _until(lambda: server.started)
    return server, protocol, sock.getsockname()[1], task


def test_a_connection_whose_next_request_is_under_way_is_not_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its next request's headers began arriving while the last one ran: a new connection
    past the cap must not close it (review finding)."""
    monkeypatch.setattr(server_module, "MIN_IDLE_AGE", 0.0)  # any idle one may go at once

    async def main() -> bytes:
        server, protocol, port, task = await _serving(1)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            await asyncio.sleep(0.02)
            writer.write(b"POST /b HTTP/1.1\r\nhost: x\r\n")  # the next, under way
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            await _until(lambda: protocol.door.idle == {} and server.server_state.connections)
            _, other = await asyncio.open_connection("127.0.0.1", port)  # over the cap
            writer.write(b"content-length: 0\r\n\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
            other.close()
            return answer
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(main()).startswith(b"HTTP/1.1 200")


def test_refusals_past_the_lingering_bound_are_not_counted_as_lingering() -> None:
    async def main() -> int:
        server, protocol, port, task = await _serving(1)
        try:
            _, busy = await asyncio.open_connection("127.0.0.1", port)
            busy.write(b"POST /a HTTP/1.1\r\nhost: x\r\n")  # busy mid-headers: not idle
            await _until(lambda: protocol.door.idle == {})
            refused = [await asyncio.open_connection("127.0.0.1", port) for _ in range(12)]
            await _until(lambda: protocol.door.lingering == 8)  # the bound: max(8, cap / 8)
            for reader, writer in refused:
                assert (await reader.read(100)).startswith(b"HTTP/1.1 503")
                writer.close()
            await _until(lambda: protocol.door.lingering <= 0)
            busy.close()
            return protocol.door.lingering
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(main()) == 0
