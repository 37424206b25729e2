"""The reaper as a real process: rotated output, exit status, group cleanup, and no
member of its command's family surviving a SIGKILL of any one of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends import family
from tests.helpers import free_port, wait_for


def test_output_is_rotated_and_exit_status_kept(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    script = "import sys\nfor i in range(400): print('line %04d ' % i + 'x' * 40)\nsys.exit(7)"
    done = subprocess.run([sys.executable, "-m", "backends.reaper", "--log", str(log),
                           "--max-bytes", "4000", "--backups", "2", "--", sys.executable, "-c",
                           script], timeout=60)
    assert done.returncode == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.log", "b.log.1", "b.log.2"]
    assert all(p.stat().st_size <= 4000 for p in tmp_path.iterdir())
    assert log.read_text().splitlines()[-1].startswith("line 0399")


def test_background_children_are_killed_when_the_command_exits(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    cmd = f"sleep 300 & echo $! > {pid_file}; exit 0"
    done = subprocess.run([sys.executable, "-m", "backends.reaper", "--log",
                           str(tmp_path / "l.log"), "--grace", "2", "--", "sh", "-c", cmd],
                          timeout=60)
    assert done.returncode == 0
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists()


# A stand-in for vLLM's family: the leader (the API server) listens on the port and starts
# a core, which starts a worker. Like vLLM, the leader stops its core on SIGTERM and exits
# when its core dies; the core stops its worker on SIGTERM; and nothing notices when the
# leader is SIGKILLed (vLLM's engine core keeps running then, re-parented to init).
STANDIN = """
import signal, socket, subprocess, sys, time
role, port = sys.argv[1], int(sys.argv[2])
below = {"leader": "core", "core": "worker"}.get(role)
child = below and subprocess.Popen([sys.executable, __file__, below, str(port)])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
if role == "leader":
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
while not stopping and (not child or child.poll() is None):
    time.sleep(0.05)
if stopping and child:
    child.terminate()
    child.wait()
sys.exit(0 if stopping else 1)
"""
GRACE = 3.0


def alive(pid: int) -> bool:
    s = family.stat(pid)
    return s is not None and s.state != "Z"


class Family:
    """The reaper running the stand-in, with the processes it started, by role."""

    def __init__(self, tmp: Path) -> None:
        script = tmp / "standin.py"
        script.write_text(STANDIN)
        self.port = free_port()
        self.record = tmp / "b.family"
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "backends.reaper", "--log", str(tmp / "b.log"), "--grace",
             str(GRACE), "--record", str(self.record), "--", sys.executable, str(script),
             "leader", str(self.port)], start_new_session=True)
        rec = wait_for(lambda: family.Record.load(self.record), 20, "the record file")
        roles = wait_for(lambda: self._roles(rec.pgid), 20, "leader, core and worker")
        self.pgid = rec.pgid
        self.leader, self.core, self.worker = roles
        wait_for(lambda: family.port_holders(self.port), 20, "the leader to listen")

    def _roles(self, pgid: int) -> tuple[int, int, int] | None:
        by_role = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2]: p
                   for p in family.group(pgid)}
        roles = tuple(by_role.get(r) for r in (b"leader", b"core", b"worker"))
        return None if None in roles else roles  # type: ignore[return-value]

    def pids(self) -> list[int]:
        return [self.leader, self.core, self.worker]

    def survivors(self) -> list[int]:
        return [p for p in self.pids() if alive(p)]

    def cleanup(self) -> None:
        for pid in [self.reaper.pid, *self.survivors()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.reaper.wait(10)


@pytest.mark.parametrize("victim", ["reaper", "leader", "core"])
def test_sigkill_of_any_member_takes_the_whole_family_down(tmp_path: Path, victim: str) -> None:
    fam = Family(tmp_path)
    try:
        assert family.port_holders(fam.port) == [fam.leader]
        assert family.members(family.Record(fam.pgid, family.stat(fam.leader).start)) == sorted(
            fam.pids())
        os.kill(fam.reaper.pid if victim == "reaper" else getattr(fam, victim), signal.SIGKILL)
        started = time.monotonic()
        wait_for(lambda: not fam.survivors(), GRACE + 2, f"no survivor after SIGKILL of {victim}")
        print(f"family gone {time.monotonic() - started:.2f} s after SIGKILL of the {victim}")
        assert family.port_free("127.0.0.1", fam.port)
    finally:
        fam.cleanup()


def test_record_names_the_group_and_goes_when_the_family_is_gone(tmp_path: Path) -> None:
    fam = Family(tmp_path)
    try:
        assert family.Record.load(fam.record) == family.record_of(fam.leader)
        fam.reaper.send_signal(signal.SIGTERM)
        assert fam.reaper.wait(GRACE + 10) == 0  # the leader's own exit status
        assert not fam.survivors()
        assert not fam.record.exists()
    finally:
        fam.cleanup()
