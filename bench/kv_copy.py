"""What a serving worker's copy of the KV index costs to keep (issue 38): applying the
control process's changes (``Index.follow``), 2,000 batches of 140 new keys held and then
released, with some of them guessed, as under load. Prints microseconds per batch.

    python -m bench.kv_copy
"""

from __future__ import annotations

import os
import time

from gateway.kv.index import KEY_BYTES, Index


def main(batches: int = 2000, keys: int = 140) -> None:
    index = Index()
    packed = [os.urandom(KEY_BYTES * keys) for _ in range(batches)]
    for p in packed[:50]:
        index.guess("vllm-1", [p[i:i + KEY_BYTES] for i in range(0, len(p), KEY_BYTES)])
    start = time.process_time()
    for p in packed:
        index.follow({"vllm-1": (False, 16, p, b"")})
    held = time.process_time()
    for p in packed:
        index.follow({"vllm-1": (False, 16, b"", p)})
    done = time.process_time()
    print(f"held: {(held - start) / batches * 1e6:.1f} us per batch of {keys} keys; "
          f"released: {(done - held) / batches * 1e6:.1f} us")


if __name__ == "__main__":
    main()
