"""The prompt tokens still to prefill on each backend, and the requests the kv policy sent
there that have not ended, added up across a gateway's serving processes. Each process sees
only its own requests; multiplying its own pending tokens by the number of processes (what
``Prefill`` does without this) is right on average and wrong at any instant: with 8 workers,
one 2,000-token miss pending in one of them counted as 16,000 tokens and made the kv policy
leave a warm instance for a cold one (issue 38, the H100's knee: in five sixths of the
rising rate the requests so moved had a slower first token than those that stayed, in the
sixth equal; ``bench/kv_rules.py``).

The same holds for requests in flight: the kv policy places a prompt cached nowhere at its
home with bounded load, which with a process's own count (about one request per instance
at 125 requests/s over 8 workers) spilled 15 to 23 % of them to a second home, a copy each.

One file, mapped into every serving process: a row per process, which only that process
writes (no locks), of ``SLOTS`` cells ``(key, tokens, requests)``, the key a backend name's
63-bit digest, placed by open addressing from the digest. A reader adds the backend's cell
of every row. A cell is never emptied, only taken over by another name when it holds
nothing, so a reader's probe never stops early. A process zeroes its row when it starts, and
the control process zeroes a dead worker's row before starting the next: a worker that
died took its requests with it. The rows are the file's: the control process sized it for
its workers.
"""

from __future__ import annotations

import hashlib
import mmap
import os

SLOTS = 256  # backend names a process keeps at once (a cell holding 0 is taken over)
CELL = 3  # int64s: the key, the tokens, the requests
TOKENS, REQUESTS = 1, 2  # a value's place in its cell
ROW = SLOTS * CELL
FILE = "pending"  # the file's name in the KV index's directory


def key(name: str) -> int:
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"vgw-pend").digest()
    return (int.from_bytes(digest, "big") >> 1) | 1  # positive, never 0 (an empty cell)


def create(path: str, rows: int) -> None:
    """The file for ``rows`` processes, all zero (the control process, before workers)."""
    with open(path, "wb") as f:
        f.truncate(rows * ROW * 8)


def clear(path: str, row: int) -> None:
    """Zero ``row``: its process ended (the control process, before starting another in
    its slot, which may not get as far as opening the map)."""
    with open(path, "r+b") as f:
        f.seek(row * ROW * 8)
        f.write(bytes(ROW * 8))


class Pending:
    """This process's row to write, every row to read (as many as the file holds, which
    the control process sized for its workers)."""

    def __init__(self, path: str, row: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            rows = os.fstat(fd).st_size // (ROW * 8)
            if not 0 <= row < rows:
                raise ValueError(f"{path}: row {row} of {rows}")
            self._map = mmap.mmap(fd, rows * ROW * 8)
        finally:
            os.close(fd)
        self._cells = memoryview(self._map).cast("q")
        self._base, self._rows = row * ROW, rows
        self._keys: dict[str, int] = {}  # name -> its key
        self._at: dict[str, int] = {}  # name -> its cell in this row
        self._names: dict[int, str] = {}  # cell -> the name it holds here
        self._cells[self._base:self._base + ROW] = memoryview(bytes(ROW * 8)).cast("q")

    def put(self, name: str, tokens: int, requests: int) -> bool:
        """This process's pending tokens and requests on ``name`` (False: the row is
        full)."""
        at = self._at.get(name)
        if at is None:
            at = self._claim(name)
            if at is None:
                return False
        self._cells[at + TOKENS] = tokens
        self._cells[at + REQUESTS] = requests
        return True

    def total(self, name: str, value: int = TOKENS) -> int:
        """Every process's pending tokens (or ``REQUESTS``) on ``name``."""
        k = self._key(name)
        start, cells, total = (k % SLOTS) * CELL, self._cells, 0
        for base in range(0, self._rows * ROW, ROW):
            for step in range(SLOTS):
                at = base + (start + step * CELL) % ROW
                held = cells[at]
                if held == k:
                    total += cells[at + value]
                    break
                if held == 0:
                    break
        return total

    def _key(self, name: str) -> int:
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = key(name)
        return k

    def _claim(self, name: str) -> int | None:
        """A cell of this row for ``name``: its own, an empty one, or one holding nothing
        for another name (which then has none here)."""
        k = self._key(name)
        start, cells = (k % SLOTS) * CELL, self._cells
        for step in range(SLOTS):
            at = self._base + (start + step * CELL) % ROW
            held = cells[at]
            if held not in (0, k) and (cells[at + TOKENS] or cells[at + REQUESTS]):
                continue
            old = self._names.pop(at, None)
            if old is not None:
                self._at.pop(old, None)
            cells[at + TOKENS] = cells[at + REQUESTS] = 0
            cells[at] = k
            self._at[name], self._names[at] = at, name
            return at
        return None
