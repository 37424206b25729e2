"""What the gateway believes each backend holds when vLLM's events cannot say (a backend
without events, a feed not yet in step, lagging, or whose predictions keep missing): the
blocks of the prompts it sent there, newest last, at most a cap per backend that what
vLLM said it found (``usage.prompt_tokens_details.cached_tokens``) corrects: a predicted
hit that came back a miss means vLLM evicted sooner than the estimate did (its cap
shrinks), a miss predicted that came back a hit the other way.

And ``Checks``: each backend's recent predictions from the events, right or wrong, so that
a backend whose predictions keep missing is routed by the estimate until they are right
again (the events are still checked meanwhile).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from gateway.kv.index import Key

CAP = 1 << 16  # blocks per backend: about 1M tokens at vLLM's GPU block size
MIN_CAP = 64  # blocks: however often vLLM evicted
DEFAULT_SIZE = 16  # vLLM's block size on GPUs, until what a backend found tells its own
WINDOW = 20  # the predictions a backend is judged on
LEAST = 10  # judged only once it made this many
MISSES = 0.25  # more wrong than this share: inexact


class Estimate:
    def __init__(self, cap: int = CAP) -> None:
        self._cap = cap
        self._held: dict[str, OrderedDict[Key, None]] = {}
        self._caps: dict[str, int] = {}  # each backend's, as what vLLM found says
        # The first cached token count vLLM reported per backend, and the gcd of all.
        self._found: dict[str, tuple[int, int]] = {}

    def size(self, backend: str) -> int:
        """``backend``'s block size as what vLLM found there says (cached token counts are
        whole blocks: their gcd, once two different counts have narrowed it); else
        ``DEFAULT_SIZE``."""
        first, gcd = self._found.get(backend, (0, 0))
        return gcd if gcd and gcd != first else DEFAULT_SIZE

    def sent(self, backend: str, keys: Sequence[Key]) -> None:
        held = self._held.setdefault(backend, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        cap = self._caps.get(backend, self._cap)
        while len(held) > cap:
            held.popitem(last=False)

    def found(self, backend: str, keys: Sequence[Key], predicted: int, blocks: int,
              tokens: int) -> None:
        """vLLM found ``tokens`` of a prompt cached (the first ``blocks`` of ``keys``) where
        ``predicted`` blocks were believed held. Found less: it evicted what this estimate
        still holds, so it holds less than believed (other processes' prompts, a smaller
        cache): its cap shrinks to what was held. Found more: its cap grows. Either way the
        prompt's blocks are there now (vLLM cached what it computed)."""
        if tokens > 0:
            self._learn(backend, tokens)
        cap = self._caps.get(backend, self._cap)
        if blocks < predicted:
            held = len(self._held.get(backend, ()))
            self._caps[backend] = max(MIN_CAP, min(cap, held) * 9 // 10)
        elif blocks > predicted:
            self._caps[backend] = min(self._cap, cap + cap // 10 + blocks)
        self.sent(backend, keys)

    def match(self, keys: Sequence[Key], backends: Iterable[str]) -> dict[str, int]:
        """For each of ``backends`` believed to hold the first block: how many leading
        blocks it holds."""
        out: dict[str, int] = {}
        for backend in backends:
            held = self._held.get(backend)
            if not held:
                continue
            n = 0
            for key in keys:
                if key not in held:
                    break
                n += 1
            if n:
                out[backend] = n
        return out

    def drop(self, backend: str) -> None:
        self._held.pop(backend, None)
        self._found.pop(backend, None)
        self._caps.pop(backend, None)

    def _learn(self, backend: str, tokens: int) -> None:
        first, gcd = self._found.get(backend, (tokens, 0))
        self._found[backend] = (first, math.gcd(gcd, tokens))


class Checks:
    """Each backend's last ``WINDOW`` predictions from the events: right or wrong."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[bool]] = {}

    def record(self, backend: str, right: bool) -> None:
        self._seen.setdefault(backend, deque(maxlen=WINDOW)).append(right)

    def inexact(self, backend: str) -> bool:
        seen = self._seen.get(backend)
        return seen is not None and len(seen) >= LEAST and seen.count(False) > MISSES * len(seen)

    def drop(self, backend: str) -> None:
        self._seen.pop(backend, None)
