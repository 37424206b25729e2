"""Each client library's exceptions become the gateway's UpstreamErrors through one table per
client: over the table's rows, and through the real clients against real sockets."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import httpx
import pytest

from gateway.config import UpstreamSection
from gateway.upstream import (
    ConnectFailed,
    UpstreamBroken,
    UpstreamError,
    aiohttp_client,
    httpx_client,
    make_upstream,
)
from gateway.upstream.base import ErrorTable

REQUEST = httpx.Request("POST", "http://backend/v1/completions")

CASES: list[tuple[ErrorTable, Exception, type[UpstreamError]]] = [
    (aiohttp_client.SENDING, aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "refused")), ConnectFailed),
    (aiohttp_client.SENDING, aiohttp.ConnectionTimeoutError("Connection timeout"), ConnectFailed),
    (aiohttp_client.SENDING, aiohttp.ServerDisconnectedError(), UpstreamBroken),
    (aiohttp_client.SENDING, aiohttp.ClientPayloadError("bad chunk"), UpstreamBroken),
    (aiohttp_client.READING, aiohttp.ClientPayloadError("bad chunk"), UpstreamBroken),
    (aiohttp_client.READING, aiohttp.ServerDisconnectedError(), UpstreamBroken),
    (httpx_client.SENDING, httpx.ConnectError("refused", request=REQUEST), ConnectFailed),
    (httpx_client.SENDING, httpx.ConnectTimeout("timed out", request=REQUEST), ConnectFailed),
    (httpx_client.SENDING, httpx.ReadError("reset", request=REQUEST), UpstreamBroken),
    (httpx_client.SENDING, httpx.RemoteProtocolError("bad", request=REQUEST), UpstreamBroken),
    (httpx_client.READING, httpx.ReadError("reset", request=REQUEST), UpstreamBroken),
    (httpx_client.READING, httpx.RemoteProtocolError("", request=REQUEST), UpstreamBroken),
]


@pytest.mark.parametrize(("table", "library", "ours"), CASES,
                         ids=[f"{type(c[1]).__name__}-{c[2].__name__}" for c in CASES])
def test_each_library_error_becomes_its_gateway_error(
    table: ErrorTable, library: Exception, ours: type[UpstreamError],
) -> None:
    assert isinstance(library, table.caught)
    translated = table.translate(library)
    assert type(translated) is ours and isinstance(translated, UpstreamError)
    assert str(translated) == (str(library) or type(library).__name__)  # never empty


def test_the_tables_catch_only_what_they_translate() -> None:
    for table in (aiohttp_client.SENDING, aiohttp_client.READING, httpx_client.SENDING,
                  httpx_client.READING):
        assert not isinstance(ValueError("a bug"), table.caught)
        assert table.caught == tuple(library for library, _ in table.rows)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _refused(client: str) -> BaseException:
    upstream = make_upstream(UpstreamSection(client=client))
    try:
        await upstream.request("POST", f"http://127.0.0.1:{_closed_port()}/v1", [], b"{}")
    except UpstreamError as exc:
        return exc
    finally:
        await upstream.aclose()
    raise AssertionError("a closed port answered")


async def _dropped_mid_body(client: str) -> BaseException:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = make_upstream(UpstreamSection(client=client))
    try:
        resp = await upstream.request("POST", f"http://127.0.0.1:{port}/v1", [], b"{}")
        try:
            while await resp.read():
                pass
        except UpstreamError as exc:
            return exc
        finally:
            await resp.aclose(reuse=False)
    finally:
        await upstream.aclose()
        server.close()
        await server.wait_closed()
    raise AssertionError("a cut body read to the end")


@pytest.mark.parametrize("client", ["httptools", "aiohttp", "httpx"])
def test_a_refused_connection_is_connect_failed_with_the_library_error_as_cause(
    client: str,
) -> None:
    exc = asyncio.run(_refused(client))
    assert isinstance(exc, ConnectFailed) and str(exc)
    # httptools parses; the socket is asyncio's own, so its error is the OSError.
    assert isinstance(exc.__cause__, aiohttp.ClientError | httpx.TransportError | OSError)


@pytest.mark.parametrize("client", ["httptools", "aiohttp", "httpx"])
def test_a_body_cut_short_is_upstream_broken(client: str) -> None:
    exc = asyncio.run(_dropped_mid_body(client))
    assert isinstance(exc, UpstreamBroken) and str(exc)
    if client != "httptools":  # the httptools client sees the cut itself: no library error
        assert isinstance(exc.__cause__, aiohttp.ClientError | httpx.TransportError)
