"""httpx as the upstream client (kept for comparison; see docs/BENCHMARKS.md)."""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from gateway.config import UpstreamSection
from gateway.upstream.base import ConnectFailed, ErrorTable, Headers, UpstreamBroken

SENDING = ErrorTable(
    (httpx.ConnectError, ConnectFailed),
    (httpx.ConnectTimeout, ConnectFailed),
    (httpx.TransportError, UpstreamBroken),
)
READING = ErrorTable((httpx.TransportError, UpstreamBroken))


class HttpxResponse:
    __slots__ = ("_chunks", "_resp", "headers", "status")

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._chunks = resp.aiter_raw()
        self.status = resp.status_code
        self.headers: Headers = list(resp.headers.raw)

    async def read(self) -> bytes:
        try:
            return await anext(self._chunks, b"")
        except READING.caught as exc:
            raise READING.translate(exc) from exc

    async def aclose(self, reuse: bool) -> None:
        # httpx closes the connection itself when the body was not read to the end.
        await self._resp.aclose()


class HttpxUpstream:
    def __init__(self, settings: UpstreamSection) -> None:
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            keepalive_expiry=60,
        )
        # No library timeouts besides connect: the proxy enforces the phase deadlines.
        timeout = httpx.Timeout(connect=settings.connect_timeout, read=None, write=None, pool=None)
        # One client serves every client of the gateway: a jar that accepts no domain keeps
        # a cookie one backend answer sets off the next request (it still passes through).
        no_cookies = CookieJar(DefaultCookiePolicy(allowed_domains=[]))
        self._client = httpx.AsyncClient(
            limits=limits, timeout=timeout, trust_env=False, cookies=no_cookies
        )

    async def request(self, method: str, url: str, headers: Headers, body: bytes) -> HttpxResponse:
        req = self._client.build_request(method, url, headers=headers, content=body)
        try:
            resp = await self._client.send(req, stream=True)
        except SENDING.caught as exc:
            raise SENDING.translate(exc) from exc
        return HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._client.aclose()
