"""Spawned backends under the real supervisor, with simulators as the spawned command.

Real processes and real signals; the vLLM integration tests repeat the essentials with
real vLLM (tests/integration/).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import Gateway, Load, free_port, wait_for

SIM = '["{python}", "-m", "gateway", "sim", "--port", "{port}", "--model", "{served_model_name}"]'
# A command that leaves a grandchild behind, to prove process groups are cleaned up.
SIM_WITH_GRANDCHILD = ('["sh", "-c", "sleep 300 & exec {python} -m gateway sim --port {port} '
                       '--model {served_model_name}"]')
CRASHING = '["{python}", "-c", "import sys; sys.exit(3)"]'
NEVER_READY = '["sleep", "300"]'


def spawned(name: str, command: str, extra: str = "") -> str:
    return (f'\n[[backends]]\nname = "{name}"\n[backends.spawn]\nmodel = "sim-model"\n'
            f"port = {free_port()}\ncommand = {command}\nstartup_timeout = 20\n{extra}\n")


def supervisor_toml(tmp: Path) -> str:
    return ("[health]\ninterval = 0.5\nfall = 2\nrise = 1\n"
            "[supervisor]\nbackoff_initial = 0.2\nbackoff_max = 1.0\ncrash_loop_restarts = 3\n"
            f'crash_loop_window = 60\nstop_grace = 3\nlog_dir = "{tmp / "backend-logs"}"\n')


def status(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw.url + "/admin/status").json()["backends"]}


def descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def chat(gw: Gateway, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    args: dict[str, Any] = {"max_tokens": 2, **extra}
    return client.chat.completions.with_raw_response.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], **args)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Gateway]:
    config = supervisor_toml(tmp_path) + spawned("s1", SIM) + spawned("s2", SIM)
    gw = Gateway(tmp_path, config, name="supervised")
    wait_for(lambda: all(b["state"] == "ready" for b in status(gw).values()), 30,
             "both spawned backends ready")
    yield gw
    gw.stop()


def test_spawned_backends_serve_and_status_shows_them(pair: Gateway, tmp_path: Path) -> None:
    seen = {chat(pair).headers["x-gateway-backend"] for _ in range(4)}
    assert seen == {"s1", "s2"}
    out = subprocess.run([sys.executable, "-m", "gateway", "status", "--config",
                          str(pair.config_path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "GROUP", "STATE", "PID"]
    assert [line.split()[2] for line in lines[1:]] == ["ready", "ready"]
    assert (tmp_path / "backend-logs" / "s1.log").exists()


def test_sigkilled_instance_is_restarted_and_requests_keep_working(pair: Gateway) -> None:
    before = status(pair)["s1"]
    (victim,) = descendants(before["pid"])  # the simulator under its reaper
    os.kill(victim, signal.SIGKILL)
    failures = 0
    deadline = time.monotonic() + 30
    while status(pair)["s1"]["restarts"] == 0 or status(pair)["s1"]["state"] != "ready":
        assert time.monotonic() < deadline, "s1 was not restarted within 30 s"
        try:
            chat(pair)  # a connection refused by s1 is retried on s2
        except openai.APIError:
            failures += 1
        if failures > 0:
            break
    assert failures == 0
    wait_for(lambda: status(pair)["s1"]["state"] == "ready", 20, "s1 back in rotation")
    after = status(pair)["s1"]
    assert after["restarts"] == 1 and after["pid"] != before["pid"]
    assert "s1" in {chat(pair).headers["x-gateway-backend"] for _ in range(4)}


def test_crash_loop_marks_failed_until_an_operator_restarts(tmp_path: Path) -> None:
    config = (supervisor_toml(tmp_path) + spawned("ok", SIM) + spawned("bad", CRASHING))
    gw = Gateway(tmp_path, config, name="crashloop")
    try:
        wait_for(lambda: status(gw)["bad"]["state"] == "failed", 30, "bad marked failed")
        assert status(gw)["bad"]["restarts"] == 3
        assert all(chat(gw).headers["x-gateway-backend"] == "ok" for _ in range(4))
        out = subprocess.run([sys.executable, "-m", "gateway", "restart", "bad", "--config",
                              str(gw.config_path)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        wait_for(lambda: status(gw)["bad"]["restarts"] > 3, 30, "an operator's restart")
    finally:
        gw.stop()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_no_process_outlives_the_gateway(tmp_path: Path, how: signal.Signals) -> None:
    config = supervisor_toml(tmp_path) + spawned("g1", SIM_WITH_GRANDCHILD)
    gw = Gateway(tmp_path, config, name=f"orphans-{how.name}")
    wait_for(lambda: status(gw)["g1"]["state"] == "ready", 30, "g1 ready")
    family = descendants(gw.proc.popen.pid)
    assert len(family) >= 3  # reaper, shell's sleep, simulator
    gw.proc.popen.send_signal(how)
    gw.proc.popen.wait(30)
    try:
        wait_for(lambda: not any(alive(p) for p in family), 30, f"no survivor after {how.name}")
    finally:
        survivors = [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:120]) for p in family
                     if alive(p)]
        for pid, _ in survivors:
            os.kill(pid, signal.SIGKILL)
        gw.stop()
        assert not survivors


def test_drain_waits_for_in_flight_then_restarts(pair: Gateway) -> None:
    results: list[str] = []

    def long_stream() -> None:
        stream = chat(pair, stream=True, max_tokens=30, extra_headers={"x-sim": "itl=0.05"})
        results.append(stream.headers["x-gateway-backend"])
        results.append("".join(c.choices[0].delta.content or "" for c in stream.parse()
                               if c.choices))

    worker = threading.Thread(target=long_stream)
    worker.start()
    wait_for(lambda: results, 10, "the stream to start")
    name = results[0]
    pid = status(pair)[name]["pid"]
    resp = httpx.post(f"{pair.url}/admin/backends/{name}/drain", json={"then": "restart"},
                      timeout=60)
    worker.join(10)
    assert resp.json()["drained"] is True
    assert results[1] == "".join(f" tok{i}" for i in range(30))  # finished, not cut
    wait_for(lambda: status(pair)[name]["state"] == "ready", 20, f"{name} ready again")
    assert status(pair)[name]["pid"] != pid


def test_rolling_restart_under_load_fails_no_request(pair: Gateway) -> None:
    pids = {n: b["pid"] for n, b in status(pair).items()}

    def one_stream() -> None:
        for _ in chat(pair, stream=True, extra_headers={"x-sim": "itl=0.02"}).parse():
            pass

    with Load(one_stream, threads=4) as load:
        resp = httpx.post(pair.url + "/admin/rolling-restart", timeout=120)
    assert resp.status_code == 200, resp.text
    assert [r["ready"] for r in resp.json()["results"]] == [True, True]
    assert len(load.outcomes) > 20 and load.failures == 0, f"{load.failures} failed"
    assert all(status(pair)[n]["pid"] != pid for n, pid in pids.items())


def test_start_up_timeout_counts_as_a_crash(tmp_path: Path) -> None:
    config = supervisor_toml(tmp_path) + spawned("ok", SIM) + spawned(
        "slow", NEVER_READY).replace("startup_timeout = 20", "startup_timeout = 1")
    gw = Gateway(tmp_path, config, name="startup-timeout")
    try:
        wait_for(lambda: status(gw)["slow"]["state"] == "failed", 40, "slow marked failed")
        assert status(gw)["slow"]["restarts"] == 3
        assert "not ready within 1 s" in gw.proc.output()
    finally:
        gw.stop()


def test_max_uptime_drains_and_restarts_without_failing_requests(tmp_path: Path) -> None:
    short = "max_uptime = 1.5\n"
    config = (supervisor_toml(tmp_path).replace("[supervisor]\n",
                                                "[supervisor]\npolicy_interval = 0.2\n")
              + spawned("u1", SIM, short) + spawned("u2", SIM))
    gw = Gateway(tmp_path, config, name="uptime")
    try:
        wait_for(lambda: status(gw)["u1"]["state"] == "ready", 30, "u1 ready")
        first = status(gw)["u1"]["pid"]
        failures = 0
        deadline = time.monotonic() + 30
        while status(gw)["u1"]["pid"] in (first, None) or status(gw)["u1"]["state"] != "ready":
            assert time.monotonic() < deadline, "u1 was not restarted within 30 s"
            try:
                chat(gw)
            except openai.APIError:
                failures += 1
            if failures:
                break
        assert failures == 0
        assert status(gw)["u1"]["restarts"] == 0  # planned, not a crash
        assert "up longer than max_uptime" in gw.proc.output()
    finally:
        gw.stop()
