"""Spawned backends under the real supervisor, with simulators as the spawned command.

Real processes and real signals; the vLLM integration tests repeat the essentials with
real vLLM (tests/integration/).
"""

from __future__ import annotations

import contextlib
import json
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

from backends import family
from tests.helpers import Gateway, Load, Sim, free_port, wait_for

SIM = '["{python}", "-m", "gateway", "sim", "--port", "{port}", "--model", "{served_model_name}"]'
# A command that leaves a grandchild behind, to prove process groups are cleaned up.
SIM_WITH_GRANDCHILD = ('["sh", "-c", "sleep 300 & exec {python} -m gateway sim --port {port} '
                       '--model {served_model_name}"]')
CRASHING = '["{python}", "-c", "import sys; sys.exit(3)"]'
NEVER_READY = '["sleep", "300"]'
# A stand-in for vLLM's family: the server (the simulator) with a core below it and a
# worker below that, which, like vLLM's engine core after a SIGKILL of its API server,
# do not notice when the server dies. Written to a file by family_command().
STANDIN = """
import os, subprocess, sys, time
role = sys.argv[1]
if role == "server":
    subprocess.Popen([sys.executable, __file__, "core"])
    os.execv(sys.executable, [sys.executable, "-m", "gateway", "sim", "--port", sys.argv[2],
                              "--model", sys.argv[3]])
if role == "core":
    subprocess.Popen([sys.executable, __file__, "worker"])
time.sleep(600)
"""
GRACE = 3.0  # stop_grace in supervisor_toml()


def family_command(tmp: Path) -> str:
    script = tmp / "standin.py"
    script.write_text(STANDIN)
    return f'["{{python}}", "{script}", "server", "{{port}}", "{{served_model_name}}"]'


def spawned(name: str, command: str, extra: str = "", port: int | None = None) -> str:
    return (f'\n[[backends]]\nname = "{name}"\n[backends.spawn]\nmodel = "sim-model"\n'
            f"port = {port or free_port()}\ncommand = {command}\nstartup_timeout = 20\n"
            f"{extra}\n")


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


def requests_until(gw: Gateway, back: Any, within: float) -> list[bool]:
    """Chat through ``gw`` until ``back(status)`` holds; one outcome per request sent."""
    outcomes: list[bool] = []
    deadline = time.monotonic() + within
    while not back(status(gw)):
        assert time.monotonic() < deadline, f"not back within {within} s"
        try:
            chat(gw)
            outcomes.append(True)
        except openai.APIError:
            outcomes.append(False)
    return outcomes


MIN_SENT = 3  # the outage lasts a restart (about a second): dozens fit in it


def test_sigkilled_instance_is_restarted_and_requests_keep_working(pair: Gateway) -> None:
    before = status(pair)["s1"]
    (victim,) = descendants(before["pid"])  # the simulator under its reaper
    os.kill(victim, signal.SIGKILL)
    # A connection refused by s1 is retried on s2, and s1 leaves rotation meanwhile.
    outage = requests_until(pair, lambda st: st["s1"]["restarts"] == 1
                            and st["s1"]["state"] == "ready", 30)
    assert len(outage) >= MIN_SENT and all(outage), f"{outage.count(False)} of {len(outage)}"
    after = status(pair)["s1"]
    assert after["restarts"] == 1 and after["pid"] != before["pid"]
    assert "s1" in {chat(pair).headers["x-gateway-backend"] for _ in range(4)}


def test_crash_loop_marks_failed_until_an_operator_restarts(tmp_path: Path) -> None:
    config = (supervisor_toml(tmp_path) + spawned("ok", SIM) + spawned("bad", CRASHING))
    gw = Gateway(tmp_path, config, name="crashloop")
    try:
        wait_for(lambda: status(gw)["bad"]["state"] == "failed", 30, "bad marked failed")
        wait_for(lambda: status(gw)["ok"]["state"] == "ready", 30, "ok ready")
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
    config = (supervisor_toml(tmp_path) + spawned("g1", SIM_WITH_GRANDCHILD)
              + spawned("g2", family_command(tmp_path)))
    gw = Gateway(tmp_path, config, name=f"orphans-{how.name}")
    wait_for(lambda: all(b["state"] == "ready" for b in status(gw).values()), 30, "g1, g2 ready")
    everyone = descendants(gw.proc.popen.pid)
    assert len(everyone) >= 7  # 2 reapers; shell's sleep, simulator; server, core, worker
    gw.proc.popen.send_signal(how)
    gw.proc.popen.wait(30)
    try:
        wait_for(lambda: not any(alive(p) for p in everyone), GRACE + 5,
                 f"no survivor after {how.name}")
    finally:
        survivors = [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:120]) for p in everyone
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


def test_a_stopped_backend_is_started_and_its_reply_says_so(pair: Gateway) -> None:
    name = sorted(status(pair))[0]
    stopped = httpx.post(f"{pair.url}/admin/backends/{name}/stop", timeout=30)
    assert stopped.json() == {"backend": name, "state": "stopped"}
    started = httpx.post(f"{pair.url}/admin/backends/{name}/start", timeout=30)
    assert started.json() == {"backend": name, "state": "starting"}
    wait_for(lambda: status(pair)[name]["state"] == "ready", 20, f"{name} ready again")
    again = httpx.post(f"{pair.url}/admin/backends/{name}/start", timeout=30)
    assert again.json() == {"backend": name, "state": "ready"}  # running: left alone


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
        wait_for(lambda: status(gw)["u1"]["state"] != "ready", 30, "u1's planned restart")
        outage = requests_until(gw, lambda st: st["u1"]["pid"] not in (first, None)
                                and st["u1"]["state"] == "ready", 30)
        assert len(outage) >= MIN_SENT and all(outage), f"{outage.count(False)} failed"
        assert status(gw)["u1"]["restarts"] == 0  # planned, not a crash
        assert "up longer than max_uptime" in gw.proc.output()
    finally:
        gw.stop()


def one_family(tmp: Path, name: str, port: int | None = None) -> tuple[Gateway, str]:
    config = supervisor_toml(tmp) + spawned(name, family_command(tmp), port=port)
    return Gateway(tmp, config, name=f"family-{name}"), config


def recorded(tmp: Path, name: str) -> list[int]:
    record = family.Record.load(tmp / "backend-logs" / f"{name}.family")
    assert record is not None
    return family.members(record)


def settled_after_restart(backend: dict[str, Any]) -> dict[str, Any] | None:
    """One status snapshot of a backend, once its first restart has settled either way."""
    done = backend["restarts"] == 1 and backend["state"] in ("ready", "failed")
    return backend if done else None


@pytest.mark.parametrize("victim", ["wrapper", "server"])
def test_sigkill_in_the_family_leaves_no_orphan_and_the_backend_comes_back(
        tmp_path: Path, victim: str) -> None:
    port = free_port()
    gw, _ = one_family(tmp_path, "f1", port)
    try:
        wait_for(lambda: status(gw)["f1"]["state"] == "ready", 30, "f1 ready")
        wrapper = status(gw)["f1"]["pid"]
        members = recorded(tmp_path, "f1")
        assert len(members) == 3  # server, core, worker
        os.kill(wrapper if victim == "wrapper" else family.port_holders(port)[0], signal.SIGKILL)
        started = time.monotonic()
        wait_for(lambda: not any(alive(p) for p in members), GRACE + 2,
                 f"no survivor of the family after SIGKILL of the {victim}")
        print(f"family gone {time.monotonic() - started:.2f} s after SIGKILL of the {victim}")
        after = wait_for(lambda: settled_after_restart(status(gw)["f1"]), 30, "f1 restarted")
        assert after["state"] == "ready" and after["pid"] != wrapper
        assert chat(gw).headers["x-gateway-backend"] == "f1"
        assert family.marker(family.port_holders(port)[0]) == "f1"
        assert not set(recorded(tmp_path, "f1")) & set(members)
    finally:
        gw.stop()


def test_gateway_and_wrapper_killed_together_next_start_clears_the_leftovers(
        tmp_path: Path) -> None:
    gw, config = one_family(tmp_path, "f2")
    wait_for(lambda: status(gw)["f2"]["state"] == "ready", 30, "f2 ready")
    members = recorded(tmp_path, "f2")
    os.kill(status(gw)["f2"]["pid"], signal.SIGKILL)
    gw.proc.popen.kill()  # both at once: no one is left to sweep the group up now
    gw.proc.popen.wait(10)
    try:
        wait_for(lambda: not alive(members[0]), 10, "the server (its parent-death signal)")
        assert any(alive(p) for p in members[1:])  # the core and worker, till the next start
        again = Gateway(tmp_path, config, name="family-f2")
        try:
            wait_for(lambda: status(again)["f2"]["state"] == "ready", 30, "f2 ready again")
            assert not any(alive(p) for p in members)
            assert "processes of its group" in again.proc.output()
        finally:
            again.stop()
    finally:
        for pid in members:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        gw.stop()


def test_an_orphan_of_ours_holding_the_port_is_killed_before_the_start(tmp_path: Path) -> None:
    port = free_port()
    script = Path(json.loads(family_command(tmp_path).replace("{python}", sys.executable))[1])
    orphan = subprocess.Popen([sys.executable, str(script), "server", str(port), "sim-model"],
                              env={**os.environ, family.MARKER: "f3"}, start_new_session=True)
    try:
        wait_for(lambda: len(family.group(orphan.pid)) == 3 and family.port_holders(port), 20,
                 "the orphan family up and listening")
        members = family.group(orphan.pid)
        gw, _ = one_family(tmp_path, "f3", port)
        try:
            # (the orphan answers probes too: wait for our own instance on the port)
            wait_for(lambda: status(gw)["f3"]["state"] == "ready" and family.supervised_by(
                family.port_holders(port)[0]) == status(gw)["f3"]["pid"], 30, "f3 ready")
            assert [family.describe(p) for p in members if alive(p)] == []
            assert status(gw)["f3"]["restarts"] == 0
            assert "is held by an orphan of this backend" in gw.proc.output()
        finally:
            gw.stop()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait(10)


def test_a_foreign_process_on_the_port_fails_the_backend_at_once_with_the_reason(
        tmp_path: Path) -> None:
    foreign = Sim(tmp_path, "foreign")
    try:
        config = supervisor_toml(tmp_path) + spawned("f4", SIM, port=foreign.port)
        gw = Gateway(tmp_path, config, name="foreign")
        try:
            wait_for(lambda: status(gw)["f4"]["state"] == "failed", 30, "f4 failed")
            assert status(gw)["f4"]["restarts"] == 0  # refused, not a crash loop
            assert (f"port {foreign.port} is held by pid {foreign.proc.popen.pid} "
                    in gw.proc.output())
            assert foreign.proc.popen.poll() is None
            assert httpx.get(foreign.url + "/health").status_code == 200
        finally:
            gw.stop()
    finally:
        foreign.stop()
