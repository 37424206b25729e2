"""The processes of one spawned backend, found through /proc even after their wrapper died.

A spawned command runs as the leader of a process group of its own (the reaper starts it
with a new session) and vLLM's engine-core and worker processes stay in that group. The
reaper writes the group to a record file, so the group can still be found, and killed,
when the reaper itself was killed hard and the family was re-parented to init.

The launcher also sets ``VGW_BACKEND=<name>`` in the command's environment, so that a
process that holds a backend's port can be recognised as one of ours. vLLM renames its
engine-core and worker processes (setproctitle), which overwrites their
``/proc/<pid>/environ``: the marker is read from the group leader as well.

Everything here reads /proc and may sleep: call it from a thread, never the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

MARKER = "VGW_BACKEND"
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass(frozen=True, slots=True)
class Stat:
    pid: int
    ppid: int
    pgid: int
    state: str
    start: int  # clock ticks after boot: tells a reused pid from the one we recorded


@dataclass(frozen=True, slots=True)
class Record:
    """A spawned command's process group, as the reaper wrote it down."""

    pgid: int
    start: int

    def dump(self) -> str:
        return f"{self.pgid} {self.start}\n"

    @classmethod
    def load(cls, path: Path) -> Record | None:
        try:
            pgid, start = path.read_text().split()
            return cls(int(pgid), int(start))
        except (OSError, ValueError):
            return None


def stat(pid: int) -> Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return Stat(pid, int(fields[1]), int(fields[2]), fields[0], int(fields[19]))


def alive(pid: int) -> bool:
    """Running, or at least not yet a zombie (a zombie holds nothing but its pid)."""
    s = stat(pid)
    return s is not None and s.state != "Z"


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = []
    for pid in _pids():
        s = stat(pid)
        if s is not None and s.pgid == pgid and s.state != "Z":
            out.append(pid)
    return out


def members(record: Record) -> list[int]:
    """The live processes of a recorded group; none when its number now means another group.

    While any member lives the kernel does not hand out the group's number again; once
    the number is reused, a leader with that pid but another start time holds it.
    """
    leader = stat(record.pgid)
    if leader is not None and leader.start != record.start:
        return []
    return group(record.pgid)


def record_of(pid: int) -> Record | None:
    s = stat(pid)
    return None if s is None else Record(s.pgid, s.start)


def marker(pid: int) -> str | None:
    """The backend name in a process's environment, else in its group leader's."""
    for candidate in (pid, *(s.pgid for s in [stat(pid)] if s is not None)):
        try:
            env = Path(f"/proc/{candidate}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(MARKER.encode() + b"="):
                return entry.split(b"=", 1)[1].decode(errors="replace")
    return None


def supervised_by(pid: int) -> int | None:
    """The live reaper above this process, if any (then it is not an orphan)."""
    s = stat(pid)
    while s is not None and s.ppid > 1:
        with contextlib.suppress(OSError):
            if b"backends.reaper" in Path(f"/proc/{s.ppid}/cmdline").read_bytes():
                return s.ppid
        s = stat(s.ppid)
    return None


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({cmd[:80].decode(errors='replace')})"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def port_holders(port: int) -> list[int]:
    """Processes with a socket listening on ``port`` (those whose fds we may read)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return []
    out = []
    for pid in _pids():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        out.append(pid)
                        break
    return out


def port_free(host: str, port: int) -> bool:
    """False when binding ``host:port`` now fails because it is in use (with SO_REUSEADDR,
    as uvicorn binds); any other failure is left for the server itself to report."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def wait_port_free(host: str, port: int, within: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + within
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def kill(find: Callable[[], Iterable[int]], grace: float, poll: float = 0.05) -> list[int]:
    """SIGTERM what ``find`` returns, SIGKILL what is left after ``grace``; return all hit.

    ``find`` is asked again on every round, so processes forked meanwhile are caught too.
    Each process gets one SIGTERM: a second one makes uvicorn skip its graceful shutdown.
    """
    hit: list[int] = []
    deadline = time.monotonic() + grace
    while alive := list(find()):
        late = time.monotonic() >= deadline
        for pid in alive:
            if late or pid not in hit:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
            if pid not in hit:
                hit.append(pid)
        if time.monotonic() >= deadline + 5:
            break  # unkillable (uninterruptible sleep): give up rather than hang
        time.sleep(poll)
    return hit
