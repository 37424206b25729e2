"""``[[adapters]]``: LoRA adapters served on their base model's instances (issue 41).

Each adapter is asked for by its ``name`` like a model. Spawned instances of its ``base``
get LoRA switched on with limits derived from the adapters declared for it (``lora_for``),
and the gateway loads an adapter on an instance the first time it sends it one of the
adapter's requests (``gateway.routing.adapters``). A url backend serves adapters when it
says so (``lora = true``: started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from backends.spec import BackendSpec, LoraLimits, Name

# vLLM accepts these as --max-lora-rank (vllm/config/lora.py: possible_max_ranks).
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ACTIVE = 4  # adapters in one batch at most (--max-loras), unless fewer are declared


def _no_parent(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL")
    return value


class AdapterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = Field(description="what clients ask for, as a model")
    path: Annotated[str, AfterValidator(_no_parent)] = Field(
        min_length=1, max_length=4096,
        description="its directory (adapter_config.json, weights), as the instances read it")
    base: str = Field(min_length=1, description="the model it adapts (as instances serve it)")
    preload: bool = Field(False, description="loaded on each instance of its base once it "
                          "is ready, rather than with its first request there")


def rank(path: str) -> int | None:
    """The adapter's rank from its ``adapter_config.json`` (``r``), if it can be read here."""
    try:
        value = json.loads((Path(path) / "adapter_config.json").read_text())["r"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def lora_for(adapters: Sequence[dict[str, Any]], base: str) -> dict[str, int] | None:
    """``LoraLimits`` for a spawned instance serving ``base``: room for every adapter
    declared for it in host memory, ``ACTIVE`` in a batch, the largest rank rounded up to
    one vLLM takes; None when no adapter adapts it."""
    mine = [a for a in adapters if isinstance(a, dict) and a.get("base") == base]
    if not mine:
        return None
    largest = max((rank(str(a.get("path", ""))) or 8 for a in mine), default=8)
    return {"max_loras": min(len(mine), ACTIVE),
            "max_lora_rank": next((r for r in RANKS if r >= largest), RANKS[-1]),
            "max_cpu_loras": len(mine)}


def derive(raw: dict[str, Any]) -> None:
    """Settings of spawned instances that other sections decide, before validation: KV
    events with ``routing.policy = "kv"`` (issue 38), LoRA limits for the adapters of the
    model each serves."""
    routing, adapters = raw.get("routing"), raw.get("adapters")
    adapters = adapters if isinstance(adapters, list) else []
    for backend in raw.get("backends") or []:
        spawn = backend.get("spawn") if isinstance(backend, dict) else None
        if not isinstance(spawn, dict):
            continue
        if isinstance(routing, dict) and routing.get("policy") == "kv":
            spawn.setdefault("kv_events", True)
        served = spawn.get("served_model_name") or spawn.get("model")
        limits = lora_for(adapters, served) if isinstance(served, str) else None
        if limits is not None:
            spawn.setdefault("lora", limits)


def adapter_problems(adapters: Sequence[AdapterSpec], backends: Sequence[BackendSpec],
                     models: set[str]) -> list[str]:
    """An adapter named like a model (``[[models]]`` names, what spawned backends serve)
    or another adapter, a base no backend serves with LoRA, or (its base spawned here) a
    directory without ``adapter_config.json``."""
    local = {b.spawn.name_served for b in backends if b.spawn is not None}
    models = models | local
    bases = {b.spawn.name_served for b in backends
             if b.spawn is not None and b.spawn.lora is not None}
    if any(b.lora for b in backends):  # a url backend's models are known later
        bases |= {a.base for a in adapters}
    problems, seen = [], set()
    for i, a in enumerate(adapters):
        if a.name in seen or a.name in models:
            problems.append(f"adapters.{i}.name: {a.name!r} is already a model or adapter")
        seen.add(a.name)
        if a.base not in bases:
            problems.append(f"adapters.{i}.base: no backend serves {a.base!r} with LoRA "
                            "(a spawned backend of that model, or a url backend with "
                            "lora = true)")
        elif a.base in local and not (Path(a.path) / "adapter_config.json").is_file():
            problems.append(f"adapters.{i}.path: no adapter_config.json in {a.path!r}")
    return problems


__all__ = ["AdapterSpec", "LoraLimits", "adapter_problems", "derive", "lora_for", "rank"]
