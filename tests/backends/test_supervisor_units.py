from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends import family
from backends.backend import Backend
from backends.health import ProbeResult
from backends.supervisor import Supervisor, SupervisorSettings
from tests import factories
from tests.helpers import free_port, wait_for


async def _probe(_: Backend) -> ProbeResult:
    return ProbeResult(ok=False)


def supervisor(jitter: float = 0.5, port: int = 9, log_dir: str = "logs") -> Supervisor:
    backend = factories.backend("s", spawn={"model": "m", "port": port})
    settings = SupervisorSettings(backoff_initial=1.0, backoff_max=8.0, stop_grace=2.0,
                                  log_dir=log_dir)
    return Supervisor(backend, settings, _probe, jitter=lambda: jitter)


def test_backoff_doubles_with_equal_jitter_and_is_capped() -> None:
    low, high = supervisor(0.0), supervisor(1.0)
    assert [low.backoff(n) for n in (1, 2, 3, 4, 5, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [high.backoff(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_repr_summarises_state() -> None:
    assert repr(supervisor(0.5)) == "<Supervisor s [starting | pid None | restarts 0]>"


# A listener with a child in its process group, like an orphaned vLLM server and its core.
LISTENER = """
import socket, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
time.sleep(300)
"""


class Listener:
    def __init__(self, port: int, env: dict[str, str], under_reaper: Path | None = None) -> None:
        cmd = [sys.executable, "-c", LISTENER, str(port)]
        if under_reaper is not None:
            cmd = [sys.executable, "-m", "backends.reaper", "--log", str(under_reaper), "--",
                   *cmd]
        self.popen = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
        self.holder = wait_for(lambda: family.port_holders(port), 20, "the listener")[0]
        self.pgid = family.stat(self.holder).pgid  # type: ignore[union-attr]
        wait_for(lambda: len(family.group(self.pgid)) == 2, 20, "the listener's child")
        self.group = family.group(self.pgid)

    def alive(self) -> list[int]:
        return family.group(self.pgid)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in self.group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.popen.wait(10)


@pytest.fixture
def port() -> Iterator[int]:
    yield free_port()


def test_an_orphan_of_ours_on_the_port_is_killed_with_its_group(port: int,
                                                                 tmp_path: Path) -> None:
    orphan = Listener(port, {family.MARKER: "s"})
    try:
        assert supervisor(port=port, log_dir=str(tmp_path)).clear_the_way() is None
        assert orphan.alive() == [] and family.port_free("127.0.0.1", port)
    finally:
        orphan.stop()


@pytest.mark.parametrize("env", [{}, {family.MARKER: "other-backend"}])
def test_a_foreign_holder_of_the_port_is_left_alone_and_reported(
        port: int, tmp_path: Path, env: dict[str, str]) -> None:
    foreign = Listener(port, env)
    try:
        problem = supervisor(port=port, log_dir=str(tmp_path)).clear_the_way()
        assert problem is not None
        assert f"port {port} is held by pid {foreign.holder} " in problem
        assert "not an orphan of this backend: not starting it" in problem
        assert sorted(foreign.alive()) == sorted(foreign.group)
    finally:
        foreign.stop()


def test_a_live_family_of_ours_under_a_reaper_is_not_an_orphan(port: int,
                                                               tmp_path: Path) -> None:
    live = Listener(port, {family.MARKER: "s"}, under_reaper=tmp_path / "r.log")
    try:
        assert family.supervised_by(live.holder) == live.popen.pid
        problem = supervisor(port=port, log_dir=str(tmp_path)).clear_the_way()
        assert problem is not None and f"held by pid {live.holder}" in problem
        assert sorted(live.alive()) == sorted(live.group)
    finally:
        live.stop()


def test_sweep_kills_the_recorded_group_and_forgets_it(port: int, tmp_path: Path) -> None:
    left = Listener(port, {})
    sup = supervisor(port=port, log_dir=str(tmp_path))
    try:
        sup.record_path.write_text(family.record_of(left.pgid).dump())  # type: ignore[union-attr]
        sup.sweep()
        assert left.alive() == [] and not sup.record_path.exists()
    finally:
        left.stop()


def test_a_recorded_group_number_now_used_by_another_process_is_not_touched(
        port: int, tmp_path: Path) -> None:
    other = Listener(port, {})
    sup = supervisor(port=port, log_dir=str(tmp_path))
    try:
        start = family.stat(other.pgid).start  # type: ignore[union-attr]
        sup.record_path.write_text(family.Record(other.pgid, start - 1).dump())
        sup.sweep()
        assert sorted(other.alive()) == sorted(other.group)
    finally:
        other.stop()
