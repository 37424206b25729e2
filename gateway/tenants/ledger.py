"""What each key used, across every worker and replica: requests and tokens per key and
minute in Redis (``use:NAME:MINUTE``, kept for the accounting window), written off the
request path in the link's shared pipelines, summed over the window for the admin view."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.state.link import RedisLink
from gateway.tenants.keyring import Keyring

MINUTE = 60

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "batch_requests",
          "batch_prompt_tokens", "batch_completion_tokens")


class Ledger:
    def __init__(self, link: RedisLink | None, keyring: Keyring, window: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._link = link
        self._keyring = keyring
        self._minutes = max(1, int(window // MINUTE))
        self._prefix = (link.prefix if link is not None else "") + "use:"
        self._clock = clock

    def record(self, tenant: str, usage: tuple[int, int] | None, batch: bool = False) -> None:
        """A request's tokens, in the key's totals (a batch line's apart: ``batch_``)."""
        # Kept only when keys are configured (a reload may add them): an open gateway has
        # one anonymous caller, and its totals are the metrics'.
        if self._link is None or self._keyring.open:
            return
        key = f"{self._prefix}{tenant}:{int(self._clock() // MINUTE)}"
        prompt, completion = usage or (0, 0)
        kind = "batch_" if batch else ""
        self._link.soon(
            ("HINCRBY", key, kind + "requests", 1),
            ("HINCRBY", key, kind + "prompt_tokens", prompt),
            ("HINCRBY", key, kind + "completion_tokens", completion),
            ("PEXPIRE", key, (self._minutes + 1) * MINUTE * 1000))

    async def totals(self) -> dict[str, Any]:
        """Each key's settings (never the key) and its totals over the window; totals are
        null when Redis can't answer."""
        now = int(self._clock() // MINUTE)
        names = list(self._keyring.tenants)
        sums: dict[str, dict[str, int] | None] = dict.fromkeys(names)
        if self._link is not None:
            commands = [("HGETALL", f"{self._prefix}{n}:{m}")
                        for n in names for m in range(now - self._minutes + 1, now + 1)]
            answered, results = await self._link.execute(*commands) if commands else (True, [])
            if answered:
                for i, name in enumerate(names):
                    total = dict.fromkeys(FIELDS, 0)
                    for found in results[i * self._minutes:(i + 1) * self._minutes]:
                        for field, value in _pairs(found):
                            if field in total:
                                total[field] += int(value)
                    sums[name] = total
        keys = []
        for name in names:
            t = self._keyring.tenants[name]
            keys.append({"name": name, "models": sorted(t.models), "priority": t.priority,
                         "rpm": t.rpm, "tpm": t.tpm, "max_concurrent": t.max_concurrent,
                         "totals": sums[name]})
        return {"window_s": self._minutes * MINUTE, "keys": keys}


def _pairs(found: object) -> list[tuple[str, str]]:
    """HGETALL's answer as (field, value) pairs: a dict (redis-py) or a flat list (RESP2)."""
    if isinstance(found, dict):
        return [(str(k), str(v)) for k, v in found.items()]
    if isinstance(found, list):
        return [(str(found[i]), str(found[i + 1])) for i in range(0, len(found) - 1, 2)]
    return []
