"""All backends, and the one place that decides which of them may take a request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from backends.backend import Backend, BackendState
from gateway.config import ModelRoute
from gateway.routing.adapters import Adapters
from gateway.routing.names import ModelNames


def _always(backend: Backend) -> bool:
    return True


def _listed(b: Backend) -> bool:
    """Its models are in ``/v1/models``: it serves them, or is started, woken or put to
    sleep by demand (a request for them waits for it)."""
    return b.routable or (b.on_demand and b.state is not BackendState.FAILED)


def _serving(b: Backend) -> frozenset[str]:
    """What it serves: as it said, or (an on-demand instance not run yet) as configured."""
    spawn = b.spec.spawn
    if b.models or spawn is None or not b.on_demand:
        return b.models
    return frozenset({spawn.name_served})


class BackendPool:
    def __init__(self, backends: Sequence[Backend],
                 allows: Callable[[Backend], bool] = _always,
                 names: ModelNames | None = None, adapters: Adapters | None = None) -> None:
        self.backends = list(backends)
        self.allows = allows  # the circuit breakers' say
        self.names = names if names is not None else ModelNames()
        self.adapters = adapters if adapters is not None else Adapters()  # LoRA, issue 41
        self.on_demand = self._any_on_demand()

    def replace(self, backends: Sequence[Backend]) -> None:
        """The backends after a reload, in place: the health checker walks the same list."""
        self.backends[:] = backends
        self.on_demand = self._any_on_demand()

    def _any_on_demand(self) -> bool:
        """Some backend is started by demand (a request may have to wait for it)."""
        return any(b.on_demand for b in self.backends)

    def remap(self, routes: Sequence[ModelRoute]) -> None:
        """A new ``[[models]]`` map (a reload). Everyone asks the pool for it per request,
        so the request body, the reply rewrite, shadows and ``/v1/models`` all follow."""
        self.names = ModelNames(routes)

    def served(self, b: Backend, model: str) -> str:
        """What ``b`` serves the client's ``model`` as (a ``[[models]]`` alias resolved:
        a model, or a LoRA adapter)."""
        return self.names.served(model, b.spec.group) if self.names else model

    def _serves(self, b: Backend, model: str, group: str | None) -> bool:
        if group is not None and b.spec.group != group:
            return False
        served = self.served(b, model)
        if self.adapters.specs and served in self.adapters.specs:
            return self.adapters.serves(b, served)
        if served in self.adapters.retired:
            return False  # removed by a reload: unloaded, whatever instances still list
        return b.serves(served)

    def candidates(self, model: str, group: str | None = None) -> list[Backend]:
        """Backends that may take a request for the client's ``model`` now (in ``group``
        when given): routable, serving it, and allowed by their breaker (for a LoRA
        adapter, those that have it loaded first: ``Adapters.prefer``)."""
        found = [b for b in self.backends
                 if b.routable and self._serves(b, model, group) and self.allows(b)]
        if found and self.adapters.specs:
            served = {self.served(b, model) for b in found}
            if len(served) == 1 and (adapter := served.pop()) in self.adapters.specs:
                return self.adapters.prefer(found, adapter)
        return found

    def ejected(self, model: str, group: str | None = None) -> list[Backend]:
        """Healthy backends serving ``model`` that only their breaker keeps out."""
        return [b for b in self.backends
                if b.routable and self._serves(b, model, group) and not self.allows(b)]

    def known_model(self, model: str, group: str | None = None) -> bool:
        """Some backend (in ``group`` when given) has said it serves ``model``."""
        return any(self._serves(b, model, group) for b in self.backends)

    def demanded(self, model: str) -> list[Backend]:
        """The spawned backends of ``model`` (of its base, for a LoRA adapter) that demand
        starts and stops (issue 39), in any state: known by what they are configured to
        serve before they first ran."""
        base = None
        if self.adapters.specs:  # an adapter, by its name or a [[models]] alias of it
            base = next((self.adapters.base(s) for s in self._aliases(model)
                         if s in self.adapters.specs), None)
        if base is not None:
            return [b for b in self.backends if b.on_demand and b.spec.serves_lora
                    and b.spec.spawn is not None and b.spec.spawn.name_served == base]
        return [b for b in self.backends if b.on_demand and (
            self._configured(b, model)
            or any(self.names.client(b.spec.group, m) == model for m in b.models))]

    def _aliases(self, model: str) -> set[str]:
        """What ``model`` is served as, in any group."""
        return {model} | {self.names.served(model, b.spec.group) for b in self.backends}

    def _configured(self, b: Backend, model: str) -> bool:
        """A spawned backend is configured to serve ``model`` (by the name clients use)."""
        return b.spec.spawn is not None and self.names.client(
            b.spec.group, b.spec.spawn.name_served) == model

    def declared(self, model: str) -> bool:
        """The config names ``model`` (a ``[[models]]`` entry, or what a spawned backend
        serves), whether or not a backend has answered for it yet: a request for it gets
        the degraded answers (reply cache, fallback model, static reply) or a 503, never
        the 404 of a model that does not exist."""
        return self.names.declares(model) or model in self.adapters.specs or any(
            self._configured(b, model) for b in self.backends)

    def models(self) -> list[str]:
        """The models of the backends that serve them or wake for them, as clients name them,
        and the adapters of those models."""
        return sorted(self.cards())

    def cards(self) -> dict[str, dict[str, Any]]:
        """``/v1/models``: each model by the name clients use, with the fields vLLM gave it
        (``max_model_len``, ``root``, ``parent``, ``owned_by``, ``permission``...) as its
        first such backend reports them; ``max_model_len`` is the smallest any of them
        takes, so a prompt that fits one fits them all."""
        merged: dict[str, dict[str, Any]] = {}
        for b in self.backends:
            if not _listed(b):
                continue
            for served in sorted(_serving(b) - self.adapters.retired):
                name = self.names.client(b.spec.group, served)
                card = b.cards.get(served) or {"object": "model", "created": 0,
                                               "owned_by": "vllm", "root": served}
                seen = merged.setdefault(name, {**card, "id": name})
                if isinstance(limit := card.get("max_model_len"), int) and isinstance(
                        seen.get("max_model_len"), int):
                    seen["max_model_len"] = min(seen["max_model_len"], limit)
        for name, adapter in self.adapters.specs.items():  # as vLLM lists one it loaded
            for b in self.backends:  # by the name clients use (a [[models]] alias of it)
                if _listed(b) and b.spec.serves_lora and adapter.base in _serving(b):
                    client = self.names.client(b.spec.group, name)
                    merged.setdefault(client, {
                        "id": client, "object": "model", "created": 0, "owned_by": "vllm",
                        "root": adapter.path, "parent": adapter.base})
        return {name: card for name, card in sorted(merged.items())
                if name not in self.adapters.retired}

    @property
    def ready(self) -> bool:
        """Some backend can serve now, or can be started for a request (on demand)."""
        return any(_listed(b) for b in self.backends)

    def __repr__(self) -> str:
        routable = sum(b.routable for b in self.backends)
        in_flight = sum(b.in_flight for b in self.backends)
        return (
            f"<BackendPool [Backends: {routable} routable, {len(self.backends) - routable} not | "
            f"Requests: {in_flight} in flight]>"
        )
