"""The httptools client against raw sockets that answer exactly what each test needs:
kept-alive connections reused, a connection the backend closed while idle retried once,
every way a reply can end (length, chunked, at close) and break, the connection cap, and a
slow reader pausing the backend instead of buffering without bound."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.config import UpstreamSection
from gateway.upstream import ConnectFailed, UpstreamBroken
from gateway.upstream.httptools_client import HIGH_WATER, HttptoolsUpstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions"


@contextlib.asynccontextmanager
async def served(handler: Handler, **settings: int) -> AsyncIterator[tuple[HttptoolsUpstream, str]]:
    """A raw backend answering with ``handler`` and a client for it, both closed after."""
    server, url = await _serve(handler)
    upstream = HttptoolsUpstream(UpstreamSection(**settings))
    try:
        yield upstream, url
    finally:
        await upstream.aclose()
        server.close()


async def _body(upstream: HttptoolsUpstream, url: str, body: bytes = b"{}") -> bytes:
    resp = await upstream.request("POST", url, [(b"x-test", b"1")], body)
    out = b""
    while chunk := await resp.read():
        out += chunk
    await resp.aclose(reuse=True)
    return out


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def test_the_request_goes_out_as_built_with_host_and_length() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        seen.append(head + await reader.readexactly(length))
        writer.write(OK)
        await writer.drain()
        writer.close()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            assert await _body(upstream, url, b'{"a":1}') == b"ok"
        port = url.split(":")[2].split("/")[0]
        assert seen == [b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:" + port.encode()
                        + b"\r\nx-test: 1\r\ncontent-length: 7\r\n\r\n" + b'{"a":1}']

    run(test)


def test_a_kept_alive_connection_is_reused_and_one_closed_while_idle_is_retried() -> None:
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for _ in range(2):  # two requests on this connection, then it closes while idle
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(OK)
            await writer.drain()
        writer.close()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            assert [await _body(upstream, url) for _ in range(2)] == [b"ok", b"ok"]
            assert len(connections) == 1  # the second request reused the first connection
            # The backend's close may not have reached the client yet: either way the third
            # request succeeds, on a new connection.
            assert await _body(upstream, url) == b"ok"
            assert len(connections) == 2

    run(test)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nabcde",  # ends at close
], ids=["chunked", "until-close"])
def test_every_framing_reads_to_its_end(reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(0, len(reply), 7):  # in pieces that cut through the framing
            writer.write(reply[i:i + 7])
            await writer.drain()
        writer.close()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            assert await _body(upstream, url) == b"abcde"

    run(test)


@pytest.mark.parametrize("reply", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",  # then closed
    b"",  # closed before any byte
], ids=["garbage", "bad-chunk", "cut-chunked", "nothing"])
def test_a_broken_reply_is_upstream_broken(reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            with pytest.raises(UpstreamBroken):
                await _body(upstream, url)
            assert upstream.open == 0  # the broken connection gave its slot back

    run(test)


def test_a_refused_connection_is_connect_failed_and_frees_its_slot() -> None:
    async def test() -> None:
        server, url = await _serve(lambda r, w: asyncio.sleep(0))
        server.close()
        await server.wait_closed()
        upstream = HttptoolsUpstream(UpstreamSection(max_connections=1))
        with pytest.raises(ConnectFailed):
            await _body(upstream, url)
        with pytest.raises(ConnectFailed):  # not stuck waiting for the first one's slot
            await _body(upstream, url)
        assert upstream.open == 0

    run(test)


def test_over_the_connection_cap_a_request_waits_for_a_free_connection() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            await reader.readexactly(2)
            await release.wait()
            writer.write(OK)
            await writer.drain()

    async def test() -> None:
        async with served(handler, max_connections_per_backend=1) as (upstream, url):
            first = asyncio.create_task(_body(upstream, url))
            second = asyncio.create_task(_body(upstream, url))
            await asyncio.sleep(0.1)
            assert upstream.open == 1 and not second.done()  # held at the cap
            release.set()
            assert await first == await second == b"ok"
            assert upstream.open == 1  # the second request reused the first's connection

    run(test)


def test_a_slow_reader_pauses_the_backend_and_pump_hands_every_chunk_over() -> None:
    sent = asyncio.Event()
    size = 32 * HIGH_WATER  # more than loopback's socket buffers can hold

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()  # returns only once the client read most of it
        sent.set()
        writer.close()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            resp = await upstream.request("POST", url, [], b"{}")
            await asyncio.sleep(0.3)  # nobody reads: the client must stop reading too
            assert not sent.is_set()
            held = resp._conn.size
            assert HIGH_WATER < held <= HIGH_WATER + 1024 * 1024  # bounded, not the whole
            got: list[bytes] = []
            gate = asyncio.Event()
            gate.set()

            def write(chunk: bytes) -> bool:
                got.append(chunk)
                return False

            await resp.pump(write, gate.wait)
            assert sum(map(len, got)) == size
            await resp.aclose(reuse=True)

    run(test)


def test_an_interim_100_continue_is_skipped_for_the_reply_after_it() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
        await writer.drain()

    async def test() -> None:
        async with served(handler) as (upstream, url):
            resp = await upstream.request("POST", url, [], b"{}")
            assert resp.status == 200
            assert (b"content-length", b"2") in resp.headers
            assert await resp.read() == b"ok"

    run(test)
