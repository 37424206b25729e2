"""The gateway's part of SSRF defence: media URLs in a request (``image_url``, ``audio_url``,
``video_url``) are fetched by vLLM, from inside the network, so with ``[gateway] media_urls
= "deny_private"`` a request naming a loopback, private, link-local (cloud metadata among
them), multicast, reserved or unspecified address, or a scheme other than http(s), is
refused with a 400 naming the field. A host name is resolved (on the loop, not blocking it)
and refused if any address it has is one of those. ``data:`` URLs carry their bytes inline
and are never fetched: they pass. vLLM resolves the name again when it fetches, so a name
whose answer changes in between (DNS rebinding) is not caught here: keep vLLM's own
``--allowed-media-domains`` and network policy too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from collections.abc import Iterator

from gateway.errors import BadRequest

KINDS = ("image_url", "audio_url", "video_url")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def media_urls(payload: dict[str, object]) -> Iterator[tuple[str, str]]:
    """(field, url) for every media URL in a chat request's messages."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            for kind in KINDS:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    yield f"messages.{i}.content.{j}.{kind}.url", url


def forbidden(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_private or address.is_loopback or address.is_link_local
            or address.is_multicast or address.is_reserved or address.is_unspecified)


async def addresses(host: str) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                             type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


async def check(payload: dict[str, object]) -> None:
    """Raise BadRequest for the first media URL the policy refuses."""
    for field, url in media_urls(payload):
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "data":
            continue
        if scheme not in ("http", "https") or not parts.hostname:
            raise BadRequest(f"{field}: only http(s) and data: media URLs are allowed", field)
        found = await addresses(parts.hostname)
        if not found:
            raise BadRequest(f"{field}: the media URL's host does not resolve", field)
        if any(forbidden(a) for a in found):
            raise BadRequest(f"{field}: the media URL points at a private, loopback, "
                             "link-local or reserved address", field)
