"""All backends, and the one place that decides which of them may take a request."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.backend import Backend


def _always(backend: Backend) -> bool:
    return True


class BackendPool:
    def __init__(self, backends: Sequence[Backend],
                 allows: Callable[[Backend], bool] = _always) -> None:
        self.backends = list(backends)
        self.allows = allows  # the circuit breakers' say, wired in by the app

    def candidates(self, model: str) -> list[Backend]:
        """Backends that may take a request for ``model`` now: routable, serving it, and
        allowed by their breaker."""
        return [b for b in self.backends if b.routable and b.serves(model) and self.allows(b)]

    def ejected(self, model: str) -> list[Backend]:
        """Healthy backends serving ``model`` that only their breaker keeps out."""
        return [b for b in self.backends
                if b.routable and b.serves(model) and not self.allows(b)]

    def known_model(self, model: str) -> bool:
        return any(b.serves(model) for b in self.backends)

    def models(self) -> list[str]:
        """The union of models over routable backends, in a stable order."""
        return sorted({m for b in self.backends if b.routable for m in b.models})

    @property
    def ready(self) -> bool:
        return any(b.routable for b in self.backends)

    def __repr__(self) -> str:
        routable = sum(b.routable for b in self.backends)
        in_flight = sum(b.in_flight for b in self.backends)
        return (
            f"<BackendPool [Backends: {routable} routable, {len(self.backends) - routable} not | "
            f"Requests: {in_flight} in flight]>"
        )
