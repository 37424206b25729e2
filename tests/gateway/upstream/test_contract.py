"""The fake upstream (``tests.fakes``) against the real client (httptools, the default):
the same reply from a backend on a real socket and from the fake reads the same through
the interface the proxy uses, and each failure is the same exception. What the proxy's unit
tests (tests/gateway/proxy) learn from the fake holds for the real client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from gateway.config import UpstreamSection
from gateway.upstream import ConnectFailed, UpstreamBroken
from gateway.upstream.httptools_client import HttptoolsUpstream
from tests.fakes import FakeUpstream, Reply, always, completion
from tests.helpers import RawBackend, free_port

REPLIES = {
    "json": completion("contract"),
    "refusal": Reply.json(400, {"error": {"message": "no", "type": "BadRequestError"}}),
    "stream": Reply(200, [(b"content-type", b"text/event-stream")],
                    [b'data: {"a":1}\n\n', b'data: {"a":2}\n\n', b"data: [DONE]\n\n"]),
    "cut": Reply(200, [(b"content-type", b"text/event-stream")], [b'data: {"a":1}\n\n'],
                 cut=True),
}


def wire(reply: Reply) -> Callable[[socket.socket, bytes], None]:
    """``reply`` as a backend writes it: Content-Length as given, else chunked."""
    def answer(conn: socket.socket, body: bytes) -> None:
        head = b"HTTP/1.1 %d X\r\n" % reply.status + b"".join(
            k + b": " + v + b"\r\n" for k, v in reply.headers)
        if any(k == b"content-length" for k, _ in reply.headers):
            conn.sendall(head + b"\r\n" + b"".join(reply.chunks))
            return
        conn.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
        for chunk in reply.chunks:
            conn.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        if not reply.cut:
            conn.sendall(b"0\r\n\r\n")
        conn.shutdown(socket.SHUT_RDWR)
    return answer


async def read_all(request: Awaitable[object]) -> tuple[int, dict[bytes, bytes], bytes, str]:
    """What the proxy sees: status, headers, the body, and how it ended."""
    reply = await request
    body, ended = b"", "end"
    try:
        while chunk := await reply.read():  # type: ignore[attr-defined]
            body += chunk
    except UpstreamBroken:
        ended = "broken"
    await reply.aclose(reuse=False)  # type: ignore[attr-defined]
    headers = {k.lower(): v for k, v in reply.headers  # type: ignore[attr-defined]
               if k.lower() in (b"content-type", b"content-length")}
    return reply.status, headers, body, ended  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_a_reply_reads_the_same_through_the_fake_and_the_real_client(kind: str) -> None:
    reply = REPLIES[kind]
    backend = RawBackend(wire(reply))
    fake = FakeUpstream({backend.url: always(reply)})
    real = HttptoolsUpstream(UpstreamSection())

    async def both() -> tuple[object, object]:
        try:
            url = backend.url + "/v1/chat/completions"
            got = await read_all(real.request("POST", url, [(b"host", b"x")], b"{}"))
            want = await read_all(fake.request("POST", url, [], b"{}"))
            return got, want
        finally:
            await real.aclose()

    try:
        got, want = asyncio.run(both())
    finally:
        backend.stop()
    assert got == want


def test_a_refused_connection_is_connect_failed_for_both() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
    real = HttptoolsUpstream(UpstreamSection())

    async def attempt(upstream: object) -> type[BaseException]:
        try:
            await upstream.request("POST", url, [], b"{}")  # type: ignore[attr-defined]
        except ConnectFailed as exc:
            return type(exc)
        finally:
            await upstream.aclose()  # type: ignore[attr-defined]
        raise AssertionError("connected")

    assert asyncio.run(attempt(real)) is asyncio.run(attempt(FakeUpstream())) is ConnectFailed
