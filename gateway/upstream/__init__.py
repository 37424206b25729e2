"""The upstream HTTP client: one per process, pooled, behind one small interface."""

from __future__ import annotations

from gateway.config import UpstreamSection
from gateway.upstream.base import (
    ConnectFailed,
    Upstream,
    UpstreamBroken,
    UpstreamError,
    UpstreamResponse,
)


def make_upstream(settings: UpstreamSection) -> Upstream:
    """The one factory from config to a client; ``client`` names the library."""
    if settings.client == "httpx":
        from gateway.upstream.httpx_client import HttpxUpstream

        return HttpxUpstream(settings)
    if settings.client == "aiohttp":
        from gateway.upstream.aiohttp_client import AiohttpUpstream

        return AiohttpUpstream(settings)
    from gateway.upstream.httptools_client import HttptoolsUpstream

    return HttptoolsUpstream(settings)


__all__ = [
    "ConnectFailed",
    "Upstream",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamResponse",
    "make_upstream",
]
