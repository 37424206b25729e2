"""Which process of a gateway this one is, and what it was told by its parent."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

ROLE_ENV = "VLLM_GATEWAY_ROLE"  # "worker" in a serving worker's environment
CONTROL_ENV = "VLLM_GATEWAY_CONTROL"  # the control socket's path
REDIS_ENV = "VLLM_GATEWAY_REDIS"  # the URL of the Redis the control process started
KV_ENV = "VLLM_GATEWAY_KV"  # the directory of the control process's KV index sockets
SLOT_ENV = "VLLM_GATEWAY_SLOT"  # a worker's number among its control process's workers


class Kind(enum.Enum):
    SINGLE = "single"  # one process does everything (workers = 1)
    CONTROL = "control"  # owns Redis and the backends' lives, serves no client
    WORKER = "worker"  # serves clients; asks the control process for the rest


@dataclass(frozen=True)
class Role:
    kind: Kind = Kind.SINGLE
    control: str | None = None  # a worker: the control socket
    redis_url: str | None = None  # a worker: the control process's embedded valkey
    kv: str | None = None  # a worker: where its control process publishes the KV index
    slot: int | None = None  # a worker: its number, 0 to the number of workers - 1

    @classmethod
    def from_env(cls) -> Role:
        if os.environ.get(ROLE_ENV) != Kind.WORKER.value:
            return cls()
        slot = os.environ.get(SLOT_ENV, "")
        return cls(Kind.WORKER, os.environ[CONTROL_ENV], os.environ.get(REDIS_ENV) or None,
                   os.environ.get(KV_ENV) or None, int(slot) if slot.isdigit() else None)

    def env(self) -> dict[str, str]:
        """What a worker's environment says of its role (the inverse of from_env)."""
        out = {ROLE_ENV: self.kind.value, CONTROL_ENV: self.control or ""}
        if self.redis_url:
            out[REDIS_ENV] = self.redis_url
        if self.kv:
            out[KV_ENV] = self.kv
        if self.slot is not None:
            out[SLOT_ENV] = str(self.slot)
        return out


SINGLE = Role()
