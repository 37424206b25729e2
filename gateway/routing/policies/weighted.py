"""Smooth weighted round robin (nginx's): each backend is chosen in proportion to its
``[[backends]] weight``, spread out rather than in runs, over whatever candidates a request
has. A weight of 0 is chosen only when every candidate has 0."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from backends.backend import Backend

CYCLE = 256  # the longest turn order ``in_turn`` writes out (weights scaled down past it)


class SmoothWeights:
    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        weights = [(b.name, b.spec.weight) for b in candidates]
        if not any(w for _, w in weights):
            weights = [(name, 1) for name, _ in weights]
        current = self._current
        best, best_value, total = candidates[0], None, 0
        for backend, (name, weight) in zip(candidates, weights, strict=True):
            value = current[name] = current.get(name, 0) + weight
            total += weight
            if weight and (best_value is None or value > best_value):
                best, best_value = backend, value
        current[best.name] -= total
        if len(current) > 4 * len(candidates) + 64:  # names gone with a reload
            for name in set(current) - {b.name for b in candidates}:
                del current[name]
        return best


def in_turn(candidates: Sequence[Backend]) -> tuple[str, ...]:
    """One whole cycle of the smooth weighted turn order over ``candidates`` (each name as
    often as its weight, spread out): what a turn counter kept elsewhere steps through."""
    return _cycle(tuple((b.name, b.spec.weight) for b in candidates))


@lru_cache(maxsize=256)
def _cycle(weights: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    if not any(w for _, w in weights):
        weights = tuple((name, 1) for name, _ in weights)
    weights = tuple((name, w) for name, w in weights if w)
    divisor = math.gcd(*(w for _, w in weights))
    total = sum(w for _, w in weights) // divisor
    scale = max(1.0, total / CYCLE)
    weights = tuple((name, max(1, round(w / divisor / scale))) for name, w in weights)
    current = dict.fromkeys((name for name, _ in weights), 0)
    total = sum(w for _, w in weights)
    order = []
    for _ in range(total):
        for name, w in weights:
            current[name] += w
        best = max(current, key=lambda name: current[name])  # the first of equals
        current[best] -= total
        order.append(best)
    return tuple(order)
