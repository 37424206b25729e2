"""The proxy's door to tenants: which key called (set by ``ApiKeyAuth``), its limits taken
in the one Redis round trip a request makes before it is routed (with its session's pin
and arm) and given back when it ends, with the tokens vLLM counted."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from gateway.http.auth import TENANT
from gateway.state.link import Command, text
from gateway.tenants.keyring import ANONYMOUS, Tenant
from gateway.tenants.ledger import Ledger
from gateway.tenants.limits import Admission, Limits
from gateway.types import BATCH_BAND, Record


class TenantGate:
    def __init__(self, limits: Limits, ledger: Ledger) -> None:
        self._limits = limits
        self._ledger = ledger

    def start(self, scope: MutableMapping[str, Any], record: Record) -> Admission | None:
        """Name the caller on ``record``; what taking its limits needs (None: it has none),
        or 403 when its key may not use the model. The proxy sends ``command`` in the
        request's one round trip and has ``admit`` judge the answer."""
        tenant: Tenant = scope.get(TENANT, ANONYMOUS)
        record.tenant, record.priority = tenant.name, tenant.priority
        if tenant.models:
            record.allowed = tenant.models
        elif not tenant.limited:
            return None
        return self._limits.prepare(tenant, record.request)

    def command(self, admission: Admission) -> Command:
        return self._limits.command(admission)

    def admit(self, record: Record, admission: Admission, answered: bool,
              result: object) -> None:
        """The limits' answer: through (what they lent is held on ``record`` until it
        ends), or their refusal raised."""
        self._limits.settle(admission, answered, result)
        record.admission = admission

    def abandon(self, admission: Admission, answer: asyncio.Future[tuple[bool, list[Any]]]
                ) -> None:
        """The request left while its limits were being taken: what the script took (its
        first answer "ok") is given back; a refusal or no answer took nothing."""
        if answer.cancelled() or answer.exception() is not None:
            return
        answered, results = answer.result()
        if answered and results and text(results[0]) == "ok":
            self._limits.release(admission, None)

    def done(self, record: Record) -> None:
        """The request ended: what its key lent it back, its tokens corrected."""
        self._ledger.record(record.tenant, record.usage, record.priority == BATCH_BAND)
        admission = record.admission
        if isinstance(admission, Admission):
            record.admission = None
            usage = record.usage
            self._limits.release(admission, sum(usage) if usage is not None else None)
