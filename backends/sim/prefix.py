"""Prefix-cache accounting in the way vLLM counts it: tokens queried and tokens hit.

Prompts are byte-tokenised and cut into fixed blocks; a block hits when the same
chain of blocks (the whole prefix up to it) was seen before.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16


class PrefixCache:
    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity_blocks
        self.queries = 0
        self.hits = 0

    def observe(self, prompt: bytes) -> int:
        """Count one prompt; return the number of prompt tokens that hit the cache."""
        full = len(prompt) - len(prompt) % BLOCK
        self.queries += len(prompt)
        key = 0
        hit = 0
        missed = False
        for start in range(0, full, BLOCK):
            key = hash((key, prompt[start : start + BLOCK]))
            if not missed and key in self._seen:
                self._seen.move_to_end(key)
                hit += BLOCK
                continue
            missed = True
            self._seen[key] = None
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        self.hits += hit
        return hit

    @property
    def usage(self) -> float:
        return len(self._seen) / self._capacity
