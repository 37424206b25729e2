"""The reaper as a real process: rotated output, exit status, group cleanup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
