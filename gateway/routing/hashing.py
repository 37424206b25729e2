"""Rendezvous (highest random weight) hashing: the same key picks the same backend in
every gateway process, and removing a backend moves only the keys it held."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from backends.backend import Backend


def score(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest())


def ranked(key: bytes, candidates: Sequence[Backend]) -> list[Backend]:
    """Candidates in ``key``'s order of preference."""
    return sorted(candidates, key=lambda b: score(key, b.name), reverse=True)


def rendezvous(key: bytes, candidates: Sequence[Backend]) -> Backend | None:
    return max(candidates, key=lambda b: score(key, b.name), default=None)
