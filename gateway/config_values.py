"""The value types of config.toml that are more than a number or a string: a listen address,
a session key's source, a Redis URL (each validated where it is parsed)."""

from __future__ import annotations

import enum


def check_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError("must be HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("port must be 1-65535")
    return value


class SessionFrom(enum.StrEnum):
    HEADER = "header"
    BODY = "body"


class SessionSource:
    """Where a session key is read: a request header, or a top-level field of the body."""

    __slots__ = ("header", "kind", "name")

    def __init__(self, kind: SessionFrom, name: str) -> None:
        self.kind = kind
        self.name = name.lower() if kind is SessionFrom.HEADER else name
        self.header = self.name.encode("latin-1") if kind is SessionFrom.HEADER else b""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SessionSource) and (self.kind, self.name) == (
            other.kind, other.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))

    def __repr__(self) -> str:
        return f"{self.kind}:{self.name}"


def session_source(value: object) -> SessionSource:
    if isinstance(value, SessionSource):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string, 'header:NAME' or 'body:FIELD'")
    kind, sep, name = value.partition(":")
    if not sep or kind not in tuple(SessionFrom) or not name:
        raise ValueError("must be 'header:NAME' or 'body:FIELD'")
    if kind == SessionFrom.HEADER and not name.isascii():
        raise ValueError("a header name must be ASCII")
    return SessionSource(SessionFrom(kind), name)


def check_redis_url(value: str) -> str:
    if value != "embedded" and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be 'embedded' or a redis://, rediss:// or unix:// URL")
    return value
