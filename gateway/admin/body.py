"""The JSON bodies the admin routes take: one table of fields, checked before any action."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from starlette.requests import Request

from gateway.errors import AdminError
from gateway.http.asgi import json_object

Check = Callable[[object], bool]


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(value: object) -> bool:
    return _number(value) and value >= 0


def _percent(value: object) -> bool:
    return _number(value) and 0 <= value <= 100


def _text(value: object) -> bool:
    return value is None or isinstance(value, str)


def _then(value: object) -> bool:
    return value in ("none", "restart", "stop")


# name -> (check, what the value must be)
FIELDS: dict[str, tuple[Check, str]] = {
    "then": (_then, "none, restart or stop"),
    "timeout": (_seconds, "a number of seconds (0 or more)"),
    "group": (_text, "a string"),
    "weight": (_percent, "a number from 0 to 100"),
    "who": (_text, "a string"),
    "why": (_text, "a string"),
}


async def read_body(request: Request, *allowed: str) -> dict[str, Any]:
    """The request's JSON object, each field one of ``allowed`` and of its type; {} when empty.

    Raises AdminError (400, naming the field in ``param``) for anything else."""
    raw = await request.body()
    if not raw:
        return {}
    body = json_object(raw, AdminError, "the body")
    for name, value in body.items():
        if name not in allowed:
            takes = ", ".join(repr(a) for a in allowed) or "no fields"
            raise AdminError(f"unknown field {name!r}; this route takes {takes}", name)
        check, what = FIELDS[name]
        if not check(value):
            raise AdminError(f"{name!r} must be {what}", name)
    return body
