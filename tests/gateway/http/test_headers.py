from __future__ import annotations

from backends.backend import Backend
from gateway.http.headers import client_response_headers, filter_headers, upstream_request_headers
from tests import factories


def backend(api_key: str | None = None) -> Backend:
    return factories.backend("b1", group="canary", api_key=api_key)


def test_connection_named_and_hop_by_hop_headers_are_dropped() -> None:
    out = filter_headers(
        [(b"Connection", b"close, X-Foo"), (b"X-Foo", b"1"), (b"Keep-Alive", b"5"),
         (b"Upgrade", b"h2c"), (b"X-Bar", b"2")],
        frozenset({b"connection", b"keep-alive", b"upgrade"}),
    )
    assert out == [(b"x-bar", b"2")]


def test_client_authorization_is_replaced_by_the_backend_key() -> None:
    client = [(b"authorization", b"Bearer client"), (b"host", b"gw"), (b"content-length", b"9"),
              (b"x-request-id", b"spoof"), (b"x-session-id", b"s1")]
    assert upstream_request_headers(client, backend("k"), "rid", b"10.0.0.1") == [
        (b"x-session-id", b"s1"), (b"x-request-id", b"rid"), (b"x-forwarded-for", b"10.0.0.1"),
        (b"authorization", b"Bearer k")]
    assert (b"authorization", b"Bearer client") not in upstream_request_headers(
        client, backend(), "rid", b"10.0.0.1")


def test_a_clients_forwarding_headers_never_reach_the_backend() -> None:
    client = [(b"x-forwarded-for", b"1.2.3.4"), (b"Forwarded", b"for=1.2.3.4"),
              (b"x-real-ip", b"1.2.3.4"), (b"x-keep", b"1")]
    assert upstream_request_headers(client, backend(), "rid", b"10.0.0.9") == [
        (b"x-keep", b"1"), (b"x-request-id", b"rid"), (b"x-forwarded-for", b"10.0.0.9")]


def test_stream_response_headers() -> None:
    upstream = [(b"Content-Type", b"text/event-stream"), (b"Content-Length", b"10"),
                (b"Transfer-Encoding", b"chunked"), (b"Cache-Control", b"max-age=5"),
                (b"Server", b"uvicorn")]
    out = client_response_headers(upstream, backend(), "rid", stream=True)
    assert out == [(b"content-type", b"text/event-stream"), (b"x-request-id", b"rid"),
                   (b"x-gateway-backend", b"b1"), (b"x-gateway-group", b"canary"),
                   (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def test_non_stream_response_keeps_its_length() -> None:
    out = client_response_headers([(b"content-length", b"10")], backend(), "r", stream=False)
    assert (b"content-length", b"10") in out
    assert (b"x-accel-buffering", b"no") not in out
