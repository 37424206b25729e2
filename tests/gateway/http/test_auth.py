from __future__ import annotations

from gateway.http.auth import ApiKeyAuth


async def _app(scope: object, receive: object, send: object) -> None:
    return None


def test_bearer_keys() -> None:
    auth = ApiKeyAuth(_app, ["k1", "k2"])  # type: ignore[arg-type]
    assert auth.allows([(b"authorization", b"Bearer k2")])
    assert auth.allows([(b"authorization", b"bearer k1")])
    assert not auth.allows([(b"authorization", b"Bearer k3")])
    assert not auth.allows([(b"authorization", b"Basic k1")])
    assert not auth.allows([(b"authorization", b"Bearer ")])
    assert not auth.allows([])
