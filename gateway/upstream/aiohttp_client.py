"""aiohttp as the upstream client (the measured default; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import aiohttp
from yarl import URL

from gateway.config import UpstreamSection
from gateway.upstream.base import ConnectFailed, Headers, UpstreamBroken


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
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc

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
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(str(exc)) from exc
        except aiohttp.ServerTimeoutError as exc:
            raise ConnectFailed(f"connect timeout: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc
        return AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
