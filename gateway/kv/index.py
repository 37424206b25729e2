"""Which backend holds which KV block, from vLLM's own events, keyed so that a request's
token ids find them: a block's key is ``blake2b(parent key, its tokens, its extra key)``,
chained from a root per LoRA adapter (``keys``), the same whether it is computed from an
event or from a request. vLLM's own block hashes (sha256 of a pickle, seeded per setting)
are only mapped to these keys per backend, for ``BlockRemoved``, never recomputed.

Events are applied whole per batch by the control plane; ``match`` answers, for a
request's keys, how many leading blocks each backend holds. With a ``Journal`` the index
also notes which keys changed holders, and ``changes`` says what they now are, so that the
serving workers' copies (``hold``, ``release``: ``gateway.kv.fanout``) follow it without
decoding the events again. An event whose parent block
the index never saw (a gap, a replay that came too late) is dropped and counted; a backend
that restarts, sleeps or resets its cache is dropped whole (``drop``).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.kv.events import Batch, BlockHash, Cleared, Removed, Stored

Key = bytes
KEY_BYTES = 8  # a key's digest size: keys travel packed, end to end
MAX_BLOCKS = 1 << 21  # per backend: beyond any real KV cache (2M blocks); more is a bad stream
GUESS_FOR = 5.0  # seconds a dispatched prompt's blocks count before vLLM's events say so
MAX_GUESSES = 1 << 18  # blocks guessed at once, over all backends; past it, all forgotten


def root(lora: str | None = None) -> Key:
    """The key a prompt's first block chains from: one per LoRA adapter (None: the base)."""
    return hashlib.blake2b(b"lora:" + (lora or "").encode(), digest_size=KEY_BYTES).digest()


def chain(parent: Key, tokens: Sequence[int], extra: object = None) -> Key:
    """One block's key from its parent's, its token ids and its extra key."""
    return _chain(parent, array("I", tokens).tobytes(), extra)


def _chain(parent: Key, ids: bytes | memoryview, extra: object) -> Key:
    """``chain`` of a block's token ids as 32-bit machine words."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(ids)
    if extra is not None:
        h.update(repr(extra).encode())
    return h.digest()


def _unpacked(packed: bytes) -> list[Key]:
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def home(blocks: Sequence[Key]) -> Key | None:
    """The key that places a prompt no backend holds: its block at the end of its first
    half (rounded up: 3 of 5 blocks), the half's length rounded down to three significant
    bits (20 of 21, 64 of 67), so prompts that share their first half (a document, a long
    system prompt) get one home whatever follows it, while prompts that share only a
    shorter preamble spread (None: a prompt under two blocks)."""
    if len(blocks) < 2:
        return None
    half = (len(blocks) + 1) // 2
    step = 1 << max(0, half.bit_length() - 3)
    return blocks[half - half % step - 1]


def keys(tokens: Sequence[int], size: int, lora: str | None = None,
         extras: Sequence[object] | None = None) -> list[Key]:
    """The keys of ``tokens``' full blocks of ``size`` (a partial last block is never
    cached, so it has none)."""
    out: list[Key] = []
    key = root(lora)
    view = memoryview(array("I", tokens[:len(tokens) // size * size]).tobytes())
    step = size * 4  # bytes of one block's token ids, as ``chain`` hashes them
    for i in range(len(tokens) // size):
        key = _chain(key, view[i * step:(i + 1) * step], extras[i] if extras else None)
        out.append(key)
    return out


@dataclass
class Counts:
    """What the index did with what it was sent, for metrics."""

    stored: int = 0  # blocks
    removed: int = 0
    orphans: int = 0  # BlockStored events whose parent was unknown: dropped
    overflows: int = 0  # backends dropped for holding more than MAX_BLOCKS


@dataclass
class Journal:
    """Which backends' keys changed holders since ``Index.changes`` was last asked, and
    which backends were dropped whole; ``wake`` is called when a batch changed any."""

    touched: dict[str, set[Key]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    wake: Callable[[], None] = lambda: None


# A backend's changes: dropped whole first, its block size, the keys it now holds and the
# keys it no longer holds (each packed, KEY_BYTES apiece).
Change = tuple[bool, int, bytes, bytes]


@dataclass
class _Held:
    """One backend's blocks: vLLM's hash -> our key, and how many of its hashes map to
    each key (a block evicted and cached again may come back under another hash)."""

    by_hash: dict[BlockHash, Key] = field(default_factory=dict)
    refs: dict[Key, int] = field(default_factory=dict)


class Index:
    def __init__(self, max_blocks: int = MAX_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_blocks
        self._clock = clock
        # Blocks of prompts just sent, not yet said stored: key -> backend -> until when.
        self._guesses: dict[Key, dict[str, float]] = {}
        # Blocks vLLM did not find where the index said they were (an event lost, a
        # restart not yet told): key -> backends, until the events store them again.
        self._stale: dict[Key, set[str]] = {}
        self._holders: dict[Key, set[str]] = {}
        self._held: dict[str, _Held] = {}
        self._sizes: dict[str, int] = {}  # each backend's block size, as its events say
        self.counts = Counts()
        self.journal: Journal | None = None

    def size(self, backend: str) -> int:
        """``backend``'s block size in tokens (0: no event from it yet)."""
        return self._sizes.get(backend, 0)

    def backends(self) -> list[str]:
        """The backends the index holds blocks of."""
        return list(self._held)

    def blocks(self, backend: str) -> int:
        held = self._held.get(backend)
        return len(held.refs) if held is not None else 0

    def apply(self, backend: str, batch: Batch) -> None:
        for event in batch.events:
            if isinstance(event, Stored):
                self._stored(backend, event)
            elif isinstance(event, Removed):
                self._removed(backend, event.hashes)
            elif isinstance(event, Cleared):
                self.drop(backend)
        if self.journal is not None:
            self.journal.wake()

    def guess(self, backend: str, keys: Sequence[Key]) -> None:
        """``backend`` was just sent a prompt with these blocks: count them as held for
        ``GUESS_FOR`` seconds, so that a burst of one prefix goes to one place before the
        events of the first request arrive."""
        if len(self._guesses) + len(keys) > MAX_GUESSES:
            self._guesses.clear()
        until = self._clock() + GUESS_FOR
        for key in keys:
            self._guesses.setdefault(key, {})[backend] = until

    def unguess(self, backend: str, keys: Sequence[Key]) -> None:
        """The prompt guessed on ``backend`` never reached it (its attempt failed)."""
        for key in keys:
            self._unguess(key, backend)

    def found(self, backend: str, keys: Sequence[Key], blocks: int) -> None:
        """vLLM found only the first ``blocks`` of a prompt's ``keys`` on ``backend``: the
        rest are not there, whatever the index believed."""
        if len(self._stale) + len(keys) > MAX_GUESSES:
            self._stale.clear()
        for key in keys[blocks:]:
            self._unguess(key, backend)
            if backend in self._holders.get(key, ()):
                self._stale.setdefault(key, set()).add(backend)

    def drop(self, backend: str) -> None:
        """Forget every block ``backend`` held (restarted, asleep, cache reset, lost)."""
        for guessed in self._guesses.values():
            guessed.pop(backend, None)
        for stale in self._stale.values():
            stale.discard(backend)
        held = self._held.pop(backend, None)
        if self.journal is not None:
            self.journal.touched.pop(backend, None)
            self.journal.dropped.add(backend)
            self.journal.wake()
        if held is None:
            return
        for key in held.refs:
            self._release(key, backend)

    def changes(self) -> dict[str, Change]:
        """What the journal noted since the last call, as each backend's holdings are now
        (a key held, then released, then held again is just held): applying them in order
        to a copy (``follow``) makes it hold what this index holds."""
        journal = self.journal
        assert journal is not None
        out: dict[str, Change] = {}
        for backend in journal.dropped | journal.touched.keys():
            refs = self._held[backend].refs if backend in self._held else {}
            held: list[Key] = []
            gone: list[Key] = []
            for key in journal.touched.get(backend, ()):
                (held if key in refs else gone).append(key)
            out[backend] = (backend in journal.dropped, self.size(backend),
                            b"".join(held), b"".join(gone))
        journal.touched.clear()
        journal.dropped.clear()
        return out

    def contents(self) -> dict[str, tuple[int, bytes]]:
        """Every backend's block size and keys, packed: what a new copy starts from."""
        return {backend: (self.size(backend), b"".join(held.refs))
                for backend, held in self._held.items()}

    def follow(self, changes: dict[str, Change]) -> None:
        """A copy's side of ``changes``: this index then holds what the other did."""
        for backend, (dropped, size, held, gone) in changes.items():
            if dropped:
                self.drop(backend)
            if size:
                self._sizes[backend] = size
            self._hold(backend, held)
            self._let_go(backend, gone)

    def _hold(self, backend: str, packed: bytes) -> None:
        refs = self._held.setdefault(backend, _Held()).refs
        holders, stale = self._holders, self._stale
        keys = _unpacked(packed)
        for key in keys:
            if key not in refs:
                refs[key] = 1
                were = holders.get(key)
                if were is None:
                    holders[key] = {backend}
                else:
                    were.add(backend)
        if stale:
            for key in stale.keys() & keys:
                stale[key].discard(backend)
        self._unguessed(keys, backend)

    def _let_go(self, backend: str, packed: bytes) -> None:
        held = self._held.get(backend)
        if held is None:
            return
        keys, refs = _unpacked(packed), held.refs
        for key in keys:
            if refs.pop(key, None) is not None:
                self._release(key, backend)
        self._unguessed(keys, backend)

    def _unguessed(self, keys: list[Key], backend: str) -> None:
        """``_unguess`` of each of ``keys``, looking only at those guessed."""
        guesses = self._guesses
        if guesses:
            for key in guesses.keys() & keys:
                self._unguess(key, backend)

    def match(self, keys: Iterable[Key]) -> dict[str, int]:
        """For each backend holding the first block: how many leading blocks it holds."""
        found: dict[str, int] = {}
        alive: set[str] | None = None
        now = self._clock()
        for n, key in enumerate(keys, 1):
            holders = self._holders.get(key, set())
            guessed = self._guesses.get(key)
            if guessed:
                holders = holders | {b for b, until in guessed.items() if until > now}
            stale = self._stale.get(key)
            if stale:
                holders = holders - stale
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for backend in alive:
                found[backend] = n
        return found

    def _stored(self, backend: str, event: Stored) -> None:
        self._sizes[backend] = event.size
        held = self._held.setdefault(backend, _Held())
        if event.parent is None:
            key = root(event.lora)
        else:
            parent = held.by_hash.get(event.parent)
            if parent is None:
                self.counts.orphans += 1
                return
            key = parent
        view, step = memoryview(event.tokens).cast("B"), event.size * 4
        for i, block in enumerate(event.hashes):
            extra = event.extra[i] if event.extra is not None else None
            key = _chain(key, view[i * step:(i + 1) * step], extra)
            stale = self._stale.get(key)
            if stale is not None:
                stale.discard(backend)  # stored again: what the events say holds
            if self.journal is not None:  # a store told again too: copies drop stale marks
                self.journal.touched.setdefault(backend, set()).add(key)
            old = held.by_hash.get(block)
            if old == key:
                continue
            if old is not None:
                self._unref(held, old, backend)
            held.by_hash[block] = key
            held.refs[key] = held.refs.get(key, 0) + 1
            self._unguess(key, backend)  # known now: the events speak for it
            self._holders.setdefault(key, set()).add(backend)
            self.counts.stored += 1
        if len(held.by_hash) > self._max:
            self.counts.overflows += 1
            self.drop(backend)

    def _removed(self, backend: str, hashes: Sequence[BlockHash]) -> None:
        held = self._held.get(backend)
        if held is None:
            return
        for block in hashes:
            key = held.by_hash.pop(block, None)
            if key is not None:
                self._unref(held, key, backend)
                self._unguess(key, backend)  # evicted: a guess of it would outlive it
                self.counts.removed += 1

    def _unguess(self, key: Key, backend: str) -> None:
        guessed = self._guesses.get(key)
        if guessed is not None and guessed.pop(backend, None) is not None and not guessed:
            del self._guesses[key]

    def _unref(self, held: _Held, key: Key, backend: str) -> None:
        left = held.refs[key] - 1
        if left:
            held.refs[key] = left
            return
        del held.refs[key]
        if self.journal is not None:
            self.journal.touched.setdefault(backend, set()).add(key)
        self._release(key, backend)

    def _release(self, key: Key, backend: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(backend)
            if not holders:
                del self._holders[key]
