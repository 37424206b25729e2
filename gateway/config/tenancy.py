"""The config of tenants: ``[[keys]]`` (who may call, and their limits), ``[limits]`` (how
limits behave when Redis can't answer) and ``[accounting]`` (usage of streams)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.spec import NAME_RE, Secret

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeySpec(_Section):
    """One API key and its tenant: ``key`` is ``env:VAR``, the key itself, or
    ``sha256:HEX`` (the digest of the key: the plain key need not be in the file)."""

    name: str
    key: Secret
    models: tuple[str, ...] = ()  # allowed models (client names); empty = all
    priority: int = Field(default=0, ge=0, le=9, description="higher is served first")
    rpm: int = Field(default=0, ge=0, description="requests per minute; 0 = no limit")
    tpm: int = Field(default=0, ge=0, description="tokens per minute; 0 = no limit")
    max_concurrent: int = Field(default=0, ge=0, description="0 = no limit")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError("must be 1-64 characters: letters, digits, '.', '_', '-'")
        return value

    @field_validator("key")
    @classmethod
    def _key(cls, value: object) -> object:
        secret = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        if isinstance(secret, str):
            if secret.startswith("sha256:") and not DIGEST_RE.fullmatch(secret):
                raise ValueError("a sha256: key must be 64 lower-case hex digits")
            if len(secret) < 8:
                raise ValueError("must be at least 8 characters")
        return value


class LimitsSection(_Section):
    # Redis can't answer: "fail_open" lets each process apply its share of every limit
    # (the limit / (replicas * workers)); "fail_closed" answers 503 to limited keys.
    on_redis_down: Literal["fail_open", "fail_closed"] = "fail_open"
    replicas: int = Field(default=1, ge=1, description="gateway replicas sharing the limits")
    # A request's tokens before its reply says: prompt bytes / 4 + its max tokens.
    default_max_tokens: int = Field(default=256, ge=0, description="when none is asked")


class QueueSection(_Section):
    """Requests held at the gateway while every backend for their model is at capacity
    (``max_concurrent``, or a spawned backend's ``--max-num-seqs``)."""

    max_length: int = Field(default=1000, ge=0, description="per process; 0 = no queue")
    max_wait: float = Field(default=30.0, gt=0, description="seconds, then 503")
    # With several keys: each backend's last places only for a tenant holding fewer than
    # the busiest one, so a quiet tenant finds one free at once under another's flood.
    reserve: int = Field(default=1, ge=0)
    # A session whose pinned backend is at capacity while another has room waits this long
    # for a place there (its prefix cache is there) before it moves; 0: it moves at once.
    pin_wait: float = Field(default=0.5, ge=0, le=60, description="seconds")


class AccountingSection(_Section):
    # A stream whose client did not ask for usage: "inject" asks vLLM for the usage chunk
    # and removes it again; "off" counts no tokens for it; "auto": inject when [[keys]] exist.
    stream_usage: Literal["auto", "off", "inject"] = "auto"
    window: float = Field(default=3600.0, gt=0, le=86400, description="admin totals span")
