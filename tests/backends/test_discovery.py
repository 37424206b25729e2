"""Discovery told another's answers (a serving worker, by its control process): no DNS
lookup, the same members as a lookup would give."""

from __future__ import annotations

import asyncio

from backends.discovery import Discovery
from backends.spec import BackendSpec


def test_a_told_discovery_expands_from_the_answers_it_is_given() -> None:
    told = {"pods": ["10.0.0.2", "fd00::3"]}
    # A server nobody runs: a lookup would fail (and keep nothing), so members prove the
    # answers came from ``told``.
    spec = BackendSpec(name="pods", discover="dns://127.0.0.1:9/vllm.test:8000", group="g")
    fixed = BackendSpec(name="fixed", url="http://127.0.0.1:8001")
    members = asyncio.run(Discovery(told=lambda: told).expand([spec, fixed]))
    assert [(m.name, m.url, m.group) for m in members] == [
        ("pods-10.0.0.2", "http://10.0.0.2:8000", "g"),
        ("pods-fd00__3", "http://[fd00::3]:8000", "g"),
        ("fixed", "http://127.0.0.1:8001", "stable")]
    told["pods"] = []
    assert [m.name for m in asyncio.run(Discovery(told=lambda: told).expand([spec]))] == []
