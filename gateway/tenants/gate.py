"""The proxy's door to tenants: which key called (set by ``ApiKeyAuth``), its limits taken
while the request is routed (the limit check and the session's pin share one Redis round
trip) and given back when it ends, with the tokens vLLM counted."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from gateway.http.auth import TENANT
from gateway.tenants.keyring import ANONYMOUS, Tenant
from gateway.tenants.ledger import Ledger
from gateway.tenants.limits import Admission, Limits
from gateway.types import Record


class TenantGate:
    def __init__(self, limits: Limits, ledger: Ledger) -> None:
        self._limits = limits
        self._ledger = ledger

    def start(self, scope: MutableMapping[str, Any], record: Record) -> asyncio.Task[None] | None:
        """Name the caller on ``record`` and start taking its limits (None: it has none).
        The task runs while the request is routed; the proxy awaits it before forwarding."""
        tenant: Tenant = scope.get(TENANT, ANONYMOUS)
        record.tenant, record.priority = tenant.name, tenant.priority
        if tenant.models:
            record.allowed = tenant.models
        elif not tenant.limited:
            return None
        return asyncio.get_running_loop().create_task(self._admit(tenant, record))

    async def _admit(self, tenant: Tenant, record: Record) -> None:
        record.admission = await self._limits.admit(tenant, record.request)

    def done(self, record: Record, admitting: asyncio.Task[None] | None) -> None:
        """The request ended: what its key lent it back, its tokens corrected. A check
        still running (the request failed first) is given back when it ends."""
        self._ledger.record(record.tenant, record.usage)
        if admitting is not None and not admitting.done():
            admitting.add_done_callback(lambda _: self._release(record))
        else:
            self._release(record)

    def _release(self, record: Record) -> None:
        admission = record.admission
        if isinstance(admission, Admission):
            record.admission = None
            usage = record.usage
            self._limits.release(admission, sum(usage) if usage is not None else None)
