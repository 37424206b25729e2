"""Which headers cross the gateway, in each direction."""

from __future__ import annotations

from collections.abc import Iterable

from backends.backend import Backend
from gateway.http.forwarded import FORWARDING

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Never forwarded upstream: the gateway sets these itself.
# ``expect``: the gateway has the whole body already (a backend's 100 Continue would only
# be an interim reply to skip).
REQUEST_DROP = HOP_BY_HOP | FORWARDING | {b"authorization", b"host", b"content-length",
                                         b"x-request-id", b"expect"}
# Never passed back: the gateway's server writes its own.
RESPONSE_DROP = HOP_BY_HOP | {b"date", b"server", b"x-request-id"}
# A stream may end early with an error event, so its length is never promised.
STREAM_RESPONSE_DROP = RESPONSE_DROP | {b"content-length", b"cache-control", b"x-accel-buffering"}
# A body the gateway rewrote: its length is the gateway's to state.
LENGTH_DROP = RESPONSE_DROP | {b"content-length"}
STREAM_HEADERS: Headers = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def _connection_named(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return named


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    """A header's value (``name`` in lower case), or b"" when absent."""
    return next((v for k, v in headers if k.lower() == name), b"")


def filter_headers(headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]) -> Headers:
    """Remove ``drop`` and every header that ``Connection`` names; lower-case the rest."""
    headers = list(headers)
    extra = _connection_named(headers)
    out: Headers = []
    for key, value in headers:
        key = key.lower()
        if key in drop or key in extra:
            continue
        out.append((key, value))
    return out


def upstream_request_headers(client: Headers, backend: Backend, request_id: str,
                             forwarded_for: bytes) -> Headers:
    """``forwarded_for``: see ``gateway.http.forwarded``."""
    out = filter_headers(client, REQUEST_DROP)
    out.append((b"x-request-id", request_id.encode()))
    out.append((b"x-forwarded-for", forwarded_for))
    if backend.spec.api_key is not None:
        token = backend.spec.api_key.get_secret_value()
        out.append((b"authorization", b"Bearer " + token.encode()))
    return out


def client_response_headers(
    upstream: Iterable[tuple[bytes, bytes]], backend: Backend, request_id: str, stream: bool,
    length: int | None = None,
) -> Headers:
    """The reply's headers for the client. ``length`` replaces the backend's
    ``Content-Length`` when the gateway changed the body (a rewritten model name)."""
    if length is not None:
        out = filter_headers(upstream, LENGTH_DROP)
        out.append((b"content-length", str(length).encode()))
    else:
        out = filter_headers(upstream, STREAM_RESPONSE_DROP if stream else RESPONSE_DROP)
    out.append((b"x-request-id", request_id.encode()))
    out.append((b"x-gateway-backend", backend.name.encode()))
    out.append((b"x-gateway-group", backend.spec.group.encode()))
    if stream:
        out.extend(STREAM_HEADERS)
    return out
