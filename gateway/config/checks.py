"""Checks of config.toml that span entries (each a ``dotted.key: message`` line): duplicate
names, ports used twice, the same API key given twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from pydantic import SecretStr

from backends.spec import BackendSpec
from gateway.config.tenancy import KeySpec

WHAT = {"backends": "backend", "keys": "key"}


def duplicate_names(raw: dict[str, Any], table: str) -> list[str]:
    """``[[backends]]`` or ``[[keys]]`` entries sharing a name."""
    entries = raw.get(table)
    if not isinstance(entries, list):
        return []
    names = [b.get("name") for b in entries if isinstance(b, dict)]
    counts = Counter(n for n in names if isinstance(n, str))
    problems = []
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str) or counts[name] < 2:
            continue
        if name in first:
            problems.append(f"{table}.{i}.name: duplicate {WHAT[table]} name {name!r} "
                            f"(first at {table}.{first[name]})")
        else:
            first[name] = i
    return problems


def duplicate_ports(backends: Sequence[BackendSpec]) -> list[str]:
    seen: dict[tuple[str, int], int] = {}
    problems = []
    for i, backend in enumerate(backends):
        if backend.spawn is None:
            continue
        key = (backend.spawn.host, backend.spawn.port)
        if key in seen:
            problems.append(f"backends.{i}.spawn.port: port {key[1]} is also used by "
                            f"backends.{seen[key]}")
        seen.setdefault(key, i)
    return problems


def duplicate_keys(keys: Sequence[KeySpec], flat: Sequence[SecretStr]) -> list[str]:
    """The same key for two tenants: which one calls could not be told (never printed)."""
    seen: dict[str, str] = {s.get_secret_value(): f"gateway.api_keys.{i}"
                            for i, s in enumerate(flat)}
    problems = []
    for i, spec in enumerate(keys):
        secret = spec.key.get_secret_value()
        if secret in seen:
            problems.append(f"keys.{i}.key: the same key as {seen[secret]}")
        seen.setdefault(secret, f"keys.{i}")
    return problems


def gpu_budgets(backends: Sequence[BackendSpec]) -> list[str]:
    """An instance that could never be awake: the GPU memory its share needs is held by
    instances that never sleep or stop (issue 39's budget)."""
    fixed: dict[int, float] = {}  # each GPU's share held for good, once started
    for backend in backends:
        spawn = backend.spawn
        if spawn is not None and spawn.sleep_after is None and spawn.stop_after is None:
            for gpu in spawn.gpus:
                fixed[gpu] = fixed.get(gpu, 0.0) + spawn.gpu_share
    problems = []
    for i, backend in enumerate(backends):
        spawn = backend.spawn
        if spawn is None or (spawn.sleep_after is None and spawn.stop_after is None):
            continue
        for gpu in spawn.gpus:
            if fixed.get(gpu, 0.0) + spawn.gpu_share > 1.0:
                problems.append(
                    f"backends.{i}.spawn.gpus: GPU {gpu} can never hold it awake: it takes "
                    f"{spawn.gpu_share:g} of its memory, and instances that never sleep or "
                    f"stop hold {fixed[gpu]:g}")
                break
    return problems
