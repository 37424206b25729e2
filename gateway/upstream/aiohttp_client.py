"""aiohttp as the upstream client (the measured default; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import aiohttp
from yarl import URL

from gateway.config import UpstreamSection
from gateway.upstream.base import ConnectFailed, ErrorTable, Headers, UpstreamBroken

# Sending: a connector error or a connect timeout (sock_read is unset, so the only
# ServerTimeoutError) reached no backend; anything else broke after it did.
SENDING = ErrorTable(
    (aiohttp.ClientConnectorError, ConnectFailed),
    (aiohttp.ServerTimeoutError, ConnectFailed),
    (aiohttp.ClientError, UpstreamBroken),
)
# Reading the body: the headers came, so every failure is a broken reply.
READING = ErrorTable(
    (aiohttp.ClientPayloadError, UpstreamBroken),
    (aiohttp.ClientConnectionError, UpstreamBroken),
)


class AiohttpResponse:
    __slots__ = ("_content", "_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._content = resp.content
        self.status = resp.status
        self.headers: Headers = list(resp.raw_headers)

    async def read(self) -> bytes:
        try:
            return await self._content.readany()
        except READING.caught as exc:
            raise READING.translate(exc) from exc

    async def aclose(self, reuse: bool) -> None:
        if reuse:
            self._resp.release()
        else:
            self._resp.close()


class AiohttpUpstream:
    def __init__(self, settings: UpstreamSection) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        # Parsed once: URLs are backend base + one of a few fixed paths, so this stays small.
        self._urls: dict[str, URL] = {}

    def _client(self) -> aiohttp.ClientSession:
        # Built lazily: aiohttp binds to the running loop.
        if self._session is None:
            s = self._settings
            connector = aiohttp.TCPConnector(
                limit=s.max_connections,
                limit_per_host=s.max_connections_per_backend,
                ttl_dns_cache=300,
                keepalive_timeout=60,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # Phase deadlines (first byte, idle, total) are enforced by the proxy.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout),
                auto_decompress=False,
                # One session serves every client: a cookie a backend sets must not ride on
                # the next client's request (it passes through to its own client untouched).
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        return self._session

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes
    ) -> AiohttpResponse:
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            parsed = self._urls.get(url)
            if parsed is None:
                parsed = self._urls[url] = URL(url)
            resp = await self._client().request(method, parsed, headers=hdrs, data=body)
        except SENDING.caught as exc:
            raise SENDING.translate(exc) from exc
        return AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
