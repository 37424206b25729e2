"""Model names: what clients send, and what each backend group serves it as."""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from gateway.config import ModelRoute
from gateway.types import Request


class ModelNames:
    def __init__(self, routes: Sequence[ModelRoute] = ()) -> None:
        self._served = {(r.name, g): s for r in routes for g, s in r.groups.items()}
        self._client = {(g, s): r.name for r in routes for g, s in r.groups.items()}
        self._fallback = {r.name: r.fallback for r in routes if r.fallback}
        self._declared = frozenset(
            [r.name for r in routes] + [r.fallback for r in routes if r.fallback])

    def declares(self, model: str) -> bool:
        """``model`` is a ``[[models]]`` entry's name, or the fallback one names."""
        return model in self._declared

    def fallback(self, model: str) -> str | None:
        """The smaller model that answers for ``model`` when none of its backends can."""
        return self._fallback.get(model) if self._fallback else None

    def served(self, model: str, group: str) -> str:
        """The name ``group`` serves the client's ``model`` under."""
        return self._served.get((model, group), model) if self._served else model

    def client(self, group: str, served: str) -> str:
        """The name clients use for what ``group`` serves as ``served``."""
        return self._client.get((group, served), served) if self._client else served

    def body_for(self, request: Request, group: str) -> bytes:
        """The request body as ``group`` must see it (its own model name)."""
        served = self.served(request.model, group)
        if served == request.model:
            return request.body
        return orjson.dumps({**request.payload, "model": served})

    def __bool__(self) -> bool:
        return bool(self._served)
