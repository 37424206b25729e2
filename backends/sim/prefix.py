"""A prefix cache counted as vLLM counts it, and told as vLLM tells it.

Prompts are byte-tokenised (one token per byte, as the simulator's ``/tokenize``) and cut
into fixed blocks; a block hits when the same chain of blocks (the whole prefix up to it)
is held. New full blocks are stored, the least recently used evicted past ``capacity``.
With ``publish`` (``--kv-events``), each change goes out as vLLM 0.32's KV events: a
``BlockStored`` map for the blocks a prompt added (uint64 hashes chained from the parent,
the blocks' token ids) and a ``BlockRemoved`` for the evicted ones.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

BLOCK = 16

Publish = Callable[[list[dict[str, Any]]], None]


def _chain(parent: int | None, block: bytes) -> int:
    """A block's hash, as vLLM publishes one: 64 bits, chained from its parent's."""
    h = hashlib.blake2b((parent or 0).to_bytes(8, "big") + block, digest_size=8)
    return int.from_bytes(h.digest(), "big")


class PrefixCache:
    def __init__(self, capacity_blocks: int = 200_000, block: int = BLOCK,
                 publish: Publish | None = None) -> None:
        self._held: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity_blocks
        self.block = block
        self._publish = publish
        self.queries = 0
        self.hits = 0

    def observe(self, prompt: bytes) -> tuple[int, int]:
        """Count one prompt: the prompt tokens that hit the cache, and those it added."""
        size = self.block
        full = len(prompt) - len(prompt) % size
        hittable = (len(prompt) - 1) // size  # vLLM computes the last token whatever it holds
        self.queries += len(prompt)
        key: int | None = None
        hit = 0
        added: list[int] = []
        parent: int | None = None
        first_new = 0
        for start in range(0, full, size):
            previous, key = key, _chain(key, prompt[start:start + size])
            if not added and key in self._held and start // size < hittable:
                self._held.move_to_end(key)
                hit += size
                continue
            if not added:
                parent, first_new = previous, start
            self._held[key] = None
            self._held.move_to_end(key)
            added.append(key)
        evicted = []
        while len(self._held) > self._capacity:
            evicted.append(self._held.popitem(last=False)[0])
        self.hits += hit
        if self._publish is not None and (added or evicted):
            self._publish(self._events(prompt, added, parent, first_new, evicted))
        return hit, len(added) * size

    def _events(self, prompt: bytes, added: list[int], parent: int | None, first: int,
                evicted: list[int]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if added:  # field by field as vLLM 0.32's BlockStored (omit_defaults)
            events.append({
                "type": "BlockStored", "block_hashes": added, "parent_block_hash": parent,
                "token_ids": list(prompt[first:first + len(added) * self.block]),
                "block_size": self.block, "lora_id": None, "medium": "GPU",
                "lora_name": None, "extra_keys": [None] * len(added), "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"})
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU",
                           "group_idx": 0})
        return events

    def clear(self) -> None:
        """Every block dropped (vLLM's prefix-cache reset: ``AllBlocksCleared``)."""
        self._held.clear()
        if self._publish is not None:
            self._publish([{"type": "AllBlocksCleared"}])

    @property
    def usage(self) -> float:
        return len(self._held) / self._capacity


class PrefillQueue:
    """One instance's prefill (``--prefill-rate``): prompts one after another, each its
    uncached tokens at the rate, so a hit is quicker than a miss and an instance can be
    hot (the kv policy's knee, simulated)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._free = 0.0  # when the prefill queued so far is done

    def wait(self, tokens: int, rate: float) -> float:
        """Seconds until ``tokens`` more, queued now, are prefilled."""
        now = self._clock()
        self._free = max(now, self._free) + tokens / rate
        return self._free - now
