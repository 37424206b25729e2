"""Validated, frozen description of one backend, as written in config.toml."""

from __future__ import annotations

import os
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def resolve_secret(value: object) -> object:
    """Turn ``env:VAR`` into the variable's value; a missing variable is an error."""
    if isinstance(value, str) and value.startswith("env:"):
        var = value[4:]
        if not var:
            raise ValueError("empty environment variable name after 'env:'")
        resolved = os.environ.get(var)
        if resolved is None or resolved == "":
            raise ValueError(f"environment variable {var} is not set")
        return resolved
    return value


Secret = Annotated[SecretStr, BeforeValidator(resolve_secret)]


def _check_http_url(value: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("URL has no host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from None
    if parts.query or parts.fragment:
        raise ValueError("URL must not have a query or fragment")
    return value.rstrip("/")


def _check_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError("must be 1-64 letters, digits, '_', '.' or '-'")
    return value


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
Name = Annotated[str, AfterValidator(_check_name)]


class BackendSpec(BaseModel):
    """One backend: a vLLM (or compatible) server reached by URL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    url: HttpUrl
    group: Name = "stable"
    api_key: Secret | None = Field(
        default=None, description="sent upstream as 'Authorization: Bearer ...'"
    )
    weight: int = Field(default=1, ge=0, le=1000)
