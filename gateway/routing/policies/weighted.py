"""Smooth weighted round robin (nginx's): each backend is chosen in proportion to its
``[[backends]] weight``, spread out rather than in runs, over whatever candidates a request
has. A weight of 0 is chosen only when every candidate has 0."""

from __future__ import annotations

from collections.abc import Sequence

from backends.backend import Backend


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
