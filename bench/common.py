"""Starting pinned processes and reading their CPU time, for the benchmarks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TICK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[1]
HAVE_TASKSET = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
PROXY_CORE, LOAD_CORE = "0", "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pinned(core: str | None, argv: list[str]) -> list[str]:
    """``argv`` bound to ``core`` (a taskset list); None leaves it to the scheduler."""
    return ["taskset", "-c", core, *argv] if HAVE_TASKSET and core is not None else argv


def start(core: str | None, argv: list[str], log: Path,
          cwd: Path | None = None, repo: Path = REPO) -> subprocess.Popen[bytes]:
    """``argv`` running the code of ``repo`` (the one beside this bench unless another
    checkout is given), whatever the working directory and the installed copy."""
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(pinned(core, argv), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd, env={**os.environ, "PYTHONPATH": path})


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not up after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree(pid: int) -> list[int]:
    """A process and all its live descendants (nginx and LiteLLM work in children)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process tree (and its reaped children), from /proc."""
    total = 0.0
    for p in tree(pid):
        try:
            total += sum(int(x) for x in _stat(p)[11:15]) / TICK
        except OSError:
            continue
    return total


def sim_argv(port: int, itl: float, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--itl", str(itl),
            *extra]


def loadgen(urls: list[str], concurrency: int, requests: int, tokens: int,
            *extra: str, core: str | None = LOAD_CORE) -> dict[str, object]:
    argv = pinned(core, [sys.executable, "-m", "bench.loadgen", *urls, "--concurrency",
                              str(concurrency), "--requests", str(requests), "--tokens",
                              str(tokens), *extra])
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def rss_peak_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) summed over a process tree, MiB."""
    total = 0
    for p in tree(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return round(total / 1024, 1)


def metric(url: str, name: str) -> float:
    """One Prometheus sample of the target's /metrics, summed over its labels (0 if absent)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    return sum((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")), 0.0)


def count_lines(log: Path, needle: str) -> int:
    if not log.exists():
        return 0
    with log.open("rb") as f:
        return sum(needle.encode() in line for line in f)
