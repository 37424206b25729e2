"""The wrapper every spawned backend runs under, so that nothing it starts outlives us.

    python -m backends.reaper --log FILE [--max-bytes N] [--backups N] [--grace S]
                              [--parent PID] [--record FILE] -- CMD...

It asks the kernel for SIGTERM when its parent (the gateway) dies, even by SIGKILL, and to
adopt orphaned descendants (child subreaper). CMD runs in a process group of its own and
gets SIGTERM from the kernel when the reaper dies, even by SIGKILL (vLLM's API server then
stops its engine core itself). The group is written to the --record file, so that the
supervisor can still kill the whole family when the reaper was killed hard.
On SIGTERM/SIGINT/SIGHUP, or when CMD exits, the reaper signals that whole group and any
adopted orphans (SIGTERM, then SIGKILL after the grace period), reaps them, and exits
with CMD's status. CMD's output goes to FILE, rotated by size.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from backends.family import Record, record_of

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(libc: ctypes.CDLL, option: int, value: int) -> None:
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _dies_with(libc: ctypes.CDLL, parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when ``parent`` dies (checked after arming,
    since the parent may die between fork and prctl). Runs before any thread exists."""
    def arm() -> None:
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return arm


def dies_with(parent: int) -> Callable[[], None]:
    """A preexec_fn for any child that must not outlive ``parent`` (SIGTERM when it dies)."""
    return _dies_with(ctypes.CDLL(None, use_errno=True), parent)


def _write_record(path: Path, record: Record) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(record.dump())
    tmp.replace(path)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _signal_all(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
    for orphan in _children(os.getpid()):  # adopted descendants that left the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(orphan, sig)


def _reap(child: subprocess.Popen[bytes]) -> None:
    """Collect every child that has exited, adopted orphans included: one ``waitpid`` per
    exit and none when nothing exited (scanning /proc ten times a second cost a few per
    cent of a core). The command's own status goes to ``child``, where Popen keeps it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)


def _copy_output(stream: object, log: logging.Logger) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        log.info(raw.decode("utf-8", "replace").rstrip("\n"))


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m backends.reaper")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--max-bytes", type=int, default=10 * 1024 * 1024)
    parser.add_argument("--backups", type=int, default=3)
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--parent", type=int, default=0, help="exit at once if not our parent")
    parser.add_argument("--record", type=Path, help="write CMD's process group here")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given")
    return args, cmd


def _output_log(path: Path, max_bytes: int, backups: int) -> logging.Logger:
    """The backend's output, rotated: one line per record, nothing added."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes,
                                                   backupCount=backups)
    handler.setFormatter(logging.Formatter("%(message)s"))
    out = logging.getLogger("backend-output")
    out.addHandler(handler)
    out.setLevel(logging.INFO)
    out.propagate = False
    return out


def _wind_down(child: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM the family, SIGKILL what is left after ``grace``; the command's exit code."""
    _signal_all(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (child.poll() is None or _children(os.getpid())):
        _reap(child)
        time.sleep(0.05)
    _signal_all(child.pid, signal.SIGKILL)
    code = child.wait()
    deadline = time.monotonic() + 5
    while _children(os.getpid()) and time.monotonic() < deadline:
        _reap(child)
        time.sleep(0.02)
    return code


def main(argv: list[str] | None = None) -> int:
    args, cmd = _arguments(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGTERM)
    if args.parent and os.getppid() != args.parent:
        return 1  # the gateway died before we could ask to be told
    _prctl(libc, PR_SET_CHILD_SUBREAPER, 1)
    out = _output_log(args.log, args.max_bytes, args.backups)

    # A flag, not a threading.Event: Event.set() from a signal handler can deadlock on the
    # lock that the interrupted Event.wait() holds.
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=_dies_with(libc, os.getpid()))
    record = record_of(child.pid)
    if args.record is not None and record is not None:
        _write_record(args.record, record)
    copier = threading.Thread(target=_copy_output, args=(child.stdout, out), daemon=True)
    copier.start()
    while child.poll() is None and not stopping:
        _reap(child)
        time.sleep(0.1)
    code = _wind_down(child, args.grace)
    copier.join(timeout=2)
    if args.record is not None:
        args.record.unlink(missing_ok=True)  # the whole family is gone
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
