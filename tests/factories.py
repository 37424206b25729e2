"""Build the gateway's objects in memory, one way for every test: backends, requests and
their records, and configs. Each factory takes keywords for what a test cares about and fills
in the rest."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backends.backend import Backend, LoadReport
from backends.spec import BackendSpec
from gateway.config import Config, parse
from gateway.types import Record, Request


def backend(name: str = "b0", url: str | None = None, *, ready: bool = False,
            models: Iterable[str] = (), in_flight: int = 0, load: LoadReport | None = None,
            **spec: Any) -> Backend:
    """A backend at ``url`` (port 1 unless given, or a ``spawn`` table), STARTING unless
    ``ready``; ``spec`` takes the other ``BackendSpec`` fields (group, api_key, spawn...)."""
    if url is None and "spawn" not in spec:
        url = "http://127.0.0.1:1"
    fields = {"name": name, **({"url": url} if url is not None else {}), **spec}
    b = Backend(BackendSpec.model_validate(fields))
    if ready:
        b.mark_ready()
    b.models, b.in_flight, b.load = frozenset(models), in_flight, load
    return b


def backends(n: int, **kw: Any) -> list[Backend]:
    """``n`` backends b0, b1... on ports 1, 2...; ``kw`` as for ``backend``."""
    return [backend(f"b{i}", f"http://127.0.0.1:{i + 1}", **kw) for i in range(n)]


def request(*, request_id: str = "r", path: str = "/v1/chat/completions", model: str = "m",
            stream: bool = False, session_key: str | None = None, body: bytes = b"",
            headers: list[tuple[bytes, bytes]] | None = None,
            payload: dict[str, object] | None = None, started: float = 0.0) -> Request:
    """A parsed request."""
    return Request(request_id=request_id, path=path, model=model, stream=stream,
                   session_key=session_key, body=body, headers=headers or [],
                   payload={} if payload is None else payload, started=started)


def record(**kw: Any) -> Record:
    """A fresh record of a request; ``kw`` as for ``request``."""
    return Record(request(**kw))


def raw_config(**sections: Any) -> dict[str, Any]:
    """A config as read from TOML: one backend ``a`` unless ``backends`` is given."""
    return {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], **sections}


def config(**sections: Any) -> Config:
    """A parsed ``Config``; ``sections`` as for ``raw_config``."""
    return parse(raw_config(**sections))
