"""Weighted rendezvous (highest random weight) hashing: the same key picks the same backend
in every gateway process, removing a backend moves only the keys it held, and each backend
draws keys in proportion to its ``weight`` (Schindelhauer and Schomaker's ``-w / ln u``;
with equal weights the order is the plain hash order)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from backends.backend import Backend

_SPAN = float(1 << 64)


def weight_of(backend: Backend) -> int:
    return backend.spec.weight


def score(key: bytes, name: str, weight: int = 1) -> float:
    h = int.from_bytes(hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest())
    if weight <= 0:
        return -1.0 / (h + 1)  # below every weighted backend, still in hash order
    return -weight / math.log((h + 0.5) / _SPAN)


def ranked(key: bytes, candidates: Sequence[Backend]) -> list[Backend]:
    """Candidates in ``key``'s order of preference."""
    return sorted(candidates, key=lambda b: score(key, b.name, weight_of(b)), reverse=True)


def rendezvous(key: bytes, candidates: Sequence[Backend]) -> Backend | None:
    return max(candidates, key=lambda b: score(key, b.name, weight_of(b)), default=None)
