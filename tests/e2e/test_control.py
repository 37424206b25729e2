"""The default process model: a control process and a serving worker per core, one port.

The gateway runs its default config (``workers = "auto"``, the embedded valkey) with a
spawned backend (a simulator under the real supervisor) and a url backend. Real processes,
real signals: which worker answered is read from ``/healthz`` on a kept connection, or from
the access log's ``pid`` by request id.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import AUTO_WORKERS_CAP
from gateway.config.values import usable_cores
from tests.e2e.test_supervision import SIM, alive, descendants, spawned
from tests.helpers import Gateway, Sim, backend_toml, wait_for

PROCESSES = max(1, min(usable_cores(), AUTO_WORKERS_CAP))
pytestmark = pytest.mark.skipif(PROCESSES < 2, reason="one core: the default is one process")
LONG = {"x-sim": "itl=0.1,tokens=30"}  # a 3 s stream


@pytest.fixture(scope="module")
def url_sim(tmp: Path) -> Iterator[Sim]:
    sim = Sim(tmp, "b", "--model", "sim-model", "--model", "other-model")
    yield sim
    sim.stop()


def config(tmp: Path, *backends: str) -> str:
    return ("[health]\ninterval = 0.3\nfall = 2\nrise = 1\n"
            f'[supervisor]\nbackoff_initial = 0.2\nlog_dir = "{tmp / "control-logs"}"\n'
            + "".join(backends))


@pytest.fixture(scope="module")
def gw(tmp: Path, url_sim: Sim) -> Iterator[Gateway]:
    gateway = Gateway(tmp, config(tmp, spawned("a", SIM), backend_toml("b", url_sim.url)),
                      name="control", workers=None)
    yield gateway
    gateway.stop()


def per_worker(gw: Gateway) -> dict[int, httpx.Client]:
    """One kept-alive client per serving worker (fresh connections until each is met)."""
    clients: dict[int, httpx.Client] = {}

    def all_met() -> bool:
        client = httpx.Client(base_url=gw.url, timeout=10)
        pid = client.get("/healthz").json()["pid"]
        if pid in clients:
            client.close()
        else:
            clients[pid] = client
        return len(clients) == PROCESSES

    wait_for(all_met, 30, "a connection to every worker")
    return clients


def states(client: httpx.Client) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in client.get("/admin/status").json()["backends"]}


def chat(client: httpx.Client, model: str = "sim-model", **headers: str) -> httpx.Response:
    return client.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def stream(client: httpx.Client, out: dict[str, Any], started: threading.Event,
           model: str = "sim-model") -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=LONG) as reply:
        out["backend"] = reply.headers["x-gateway-backend"]
        events = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    out["events"], out["ended"] = events, time.monotonic()


def streaming(client: httpx.Client, model: str = "sim-model",
              ) -> tuple[threading.Thread, dict[str, Any]]:
    """A 3 s stream through ``client``, begun: its thread, and what it will have got."""
    out: dict[str, Any] = {}
    started = threading.Event()
    thread = threading.Thread(target=stream, args=(client, out, started, model))
    thread.start()
    assert started.wait(10)
    return thread, out


def test_the_default_is_a_control_process_and_a_worker_per_core(gw: Gateway) -> None:
    clients = per_worker(gw)
    control = gw.proc.popen.pid
    assert control not in clients
    family = descendants(control)
    assert set(clients) <= family
    for client in clients.values():
        wait_for(lambda c=client: states(c)["a"]["state"] == "ready", 30, "a ready everywhere")
        assert chat(client).status_code == 200
    spawned_pid = states(next(iter(clients.values())))["a"]["pid"]
    assert int(Path(f"/proc/{spawned_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
        == control  # supervised by the control process, not by a worker
    valkeys = [p for p in family if program(p).endswith(b"valkey-server")]
    assert len(valkeys) == 1  # one embedded Redis, shared by the workers


def program(pid: int) -> bytes:
    """argv[0] (valkey rewrites its title into one string: its first word)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].split(b" ")[0]


def access_pids(gw: Gateway) -> dict[str, int]:
    lines = [json.loads(line) for line in gw.proc.output().splitlines()
             if line.startswith("{") and '"gateway.access"' in line]
    return {line["id"]: line["pid"] for line in lines}


def test_sessions_stick_across_workers(gw: Gateway) -> None:
    placed: dict[str, set[str]] = {}
    ids: dict[str, list[str]] = {}
    for turn in range(4):
        for n in range(12):
            session = f"s{n}"
            # A fresh connection for each request: any worker may take it.
            reply = chat(httpx.Client(base_url=gw.url, timeout=10),
                         **{"x-session-id": session, "connection": "close"})
            assert reply.status_code == 200, (turn, reply.text)
            placed.setdefault(session, set()).add(reply.headers["x-gateway-backend"])
            ids.setdefault(session, []).append(reply.headers["x-request-id"])
    assert all(len(backends) == 1 for backends in placed.values()), placed
    assert {b for backends in placed.values() for b in backends} == {"a", "b"}
    wanted = [i for ids_ in ids.values() for i in ids_]

    def logged() -> dict[str, int] | None:
        found = access_pids(gw)
        return found if all(i in found for i in wanted) else None

    pids = wait_for(logged, 10, "the access lines")
    crossed = [s for s, ids_ in ids.items() if len({pids[i] for i in ids_}) > 1]
    assert len(crossed) >= 3, "sessions should have met more than one worker"


def test_a_spawned_backend_is_restarted_once_and_every_worker_sees_it(gw: Gateway) -> None:
    clients = per_worker(gw)
    first = next(iter(clients.values()))
    before = states(first)["a"]
    (sim,) = [p for p in descendants(before["pid"]) if b"sim" in
              Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(sim, signal.SIGKILL)
    for client in clients.values():
        wait_for(lambda c=client: (s := states(c)["a"])["state"] == "ready"
                 and s["restarts"] == before["restarts"] + 1 and s["pid"] != before["pid"],
                 30, "the restarted backend, ready in every worker")
        assert chat(client, **{"x-session-id": "s0"}).status_code == 200
    assert gw.proc.output().count("backend a exited") == 1  # restarted once, by one process


def test_a_drain_waits_for_the_streams_of_every_worker(gw: Gateway) -> None:
    clients = list(per_worker(gw).values())
    streamer, operator = clients[0], clients[1]
    thread, out = streaming(streamer, "other-model")
    reply = operator.post("/admin/backends/b/drain", json={"timeout": 30})
    returned = time.monotonic()
    thread.join(10)
    assert reply.json()["drained"] is True and out["backend"] == "b"
    assert out["events"][-1] == "[DONE]" and len(out["events"]) >= 30
    assert returned >= out["ended"], "the drain returned while a stream was still on b"
    for client in clients:  # out of rotation everywhere: other-model has no other backend
        assert chat(client, "other-model").status_code == 503
    assert operator.post("/admin/backends/b/start").status_code == 200
    for client in clients:
        wait_for(lambda c=client: states(c)["b"]["state"] == "ready", 10, "b back everywhere")


def test_a_dead_worker_is_replaced_and_the_others_streams_go_on(gw: Gateway) -> None:
    clients = per_worker(gw)
    (keep, streamer), (victim, _) = list(clients.items())[:2]
    thread, out = streaming(streamer)
    os.kill(victim, signal.SIGKILL)
    thread.join(10)
    assert out["events"][-1] == "[DONE]" and len(out["events"]) == 32  # role, 30 tokens, DONE
    fresh = per_worker(gw)
    assert victim not in fresh and keep in fresh and len(fresh) == PROCESSES
    assert "exited with -9: starting another" in gw.proc.output()
    for client in fresh.values():
        assert chat(client).status_code == 200


def test_every_worker_shows_the_replicas_counts(gw: Gateway) -> None:
    """Seven sessions pinned through whichever workers their connections reach: the status
    page of every worker counts all seven (issue 37: it showed 3 or 4 by worker)."""

    def views() -> set[int]:
        seen = set()
        for _ in range(20):  # fresh connections: each may reach another worker
            data = httpx.get(gw.url + "/dashboard/data", headers={"connection": "close"})
            seen.add(sum(b["pins"] for b in data.json()["backends"]))
        return seen

    before = wait_for(lambda: (v := views()) and len(v) == 1 and v.pop(), 10, "one count")
    tag = os.urandom(4).hex()
    for n in range(7):
        reply = httpx.post(gw.url + "/v1/chat/completions", headers={
            "connection": "close", "x-session-id": f"replica-{tag}-{n}"}, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1})
        assert reply.status_code == 200
    wait_for(lambda: views() == {before + 7}, 10, "every worker to count all seven pins")


def replaced(client: httpx.Client, why: str) -> float:
    text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'gateway_workers_replaced{{reason="{why}"'))


def test_a_hung_worker_is_killed_and_replaced_and_the_others_streams_go_on(
    gw: Gateway,
) -> None:
    """SIGSTOP, not SIGKILL: the worker's process lives on, only its reports stop."""
    clients = per_worker(gw)
    (keep, streamer), (victim, _) = list(clients.items())[:2]
    before = replaced(streamer, "hung")
    thread, out = streaming(streamer)
    os.kill(victim, signal.SIGSTOP)
    try:
        wait_for(lambda: f"worker pid {victim} has not reported" in gw.proc.output(), 15,
                 "the hung worker found")
        wait_for(lambda: not alive(victim), 10, "the hung worker killed")
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
    thread.join(10)
    assert out["events"][-1] == "[DONE]" and len(out["events"]) == 32
    fresh = per_worker(gw)
    assert victim not in fresh and keep in fresh and len(fresh) == PROCESSES
    wait_for(lambda: replaced(fresh[keep], "hung") == before + 1, 5, "the replacement counted")
    for client in fresh.values():
        assert chat(client).status_code == 200


def test_workers_that_lose_the_control_process_serve_on_and_say_so(gw: Gateway) -> None:
    clients = per_worker(gw)
    control = gw.proc.popen.pid
    logged = gw.proc.output().count("hung, killed")
    os.kill(control, signal.SIGSTOP)
    try:
        for client in clients.values():
            wait_for(lambda client=client: client.get("/readyz").json()["control"].startswith(
                "unreachable for"), 10, "the worker to notice")  # type: ignore[misc]
            assert client.get("/readyz").json()["ready"] is True
            assert chat(client).status_code == 200
    finally:
        os.kill(control, signal.SIGCONT)
    for client in clients.values():
        wait_for(lambda client=client: client.get("/readyz").json()["control"] == "reachable",
                 10, "the control process back")  # type: ignore[misc]
    assert per_worker(gw).keys() == clients.keys()  # nobody was taken for hung meanwhile
    assert gw.proc.output().count("hung, killed") == logged


def test_a_reload_reaches_every_worker(gw: Gateway, tmp: Path, url_sim: Sim) -> None:
    """The control process reads and checks the file once; each worker applies what it
    read (told through the control socket), without reading the file itself."""
    extra = Sim(tmp, "c")
    try:
        text = gw.config_path.read_text()
        gw.config_path.write_text(text + backend_toml("c", extra.url))
        before = gw.proc.output().count("config reloaded by")
        os.kill(gw.proc.popen.pid, signal.SIGHUP)
        wait_for(lambda: "config reloaded by SIGHUP" in gw.proc.output(), 10, "the reload")
        gw.config_path.write_text("not [valid toml")  # too late to matter: it was read
        clients = per_worker(gw)
        for client in clients.values():
            wait_for(lambda c=client: states(c).get("c", {}).get("state") == "ready", 10,
                     "c in every worker")
        wait_for(lambda: gw.proc.output().count("config reloaded by") == before + 1 + len(
            clients), 10, "every worker's reload said")
        reloads = gw.proc.output().split("config reloaded by")[before + 1:]
        assert sorted(r.split(":")[0].strip() for r in reloads) == [
            "SIGHUP", *["control"] * len(clients)]  # read once, by the control process
        gw.config_path.write_text(text)
        reply = next(iter(clients.values())).post("/admin/reload", json={"who": "test"})
        assert reply.status_code == 200 and reply.json()["removed"] == ["c"]
        for client in clients.values():
            wait_for(lambda c=client: "c" not in states(c), 10, "c gone from every worker")
    finally:
        extra.stop()


def test_a_worker_started_after_an_edit_runs_the_control_processs_config(
        gw: Gateway, url_sim: Sim) -> None:
    """The file edited but not reloaded: a worker that replaces a dead one runs the config
    its control process runs (kept in its private dir), not the edit; the reload applies
    it everywhere."""
    text = gw.config_path.read_text()
    try:
        gw.config_path.write_text(text + backend_toml("edited", url_sim.url))
        victim = next(iter(per_worker(gw)))
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: victim not in per_worker(gw), 30, "the dead worker replaced")
        for client in per_worker(gw).values():
            assert set(states(client)) == {"a", "b"}  # the new worker too: no "edited"
    finally:
        gw.config_path.write_text(text)


def test_sigterm_stops_the_workers_the_backends_and_valkey(gw: Gateway) -> None:
    per_worker(gw)
    family = descendants(gw.proc.popen.pid)
    assert len(family) >= PROCESSES + 3  # workers, valkey and its reaper, a's reaper and sim
    gw.proc.popen.send_signal(signal.SIGTERM)
    assert gw.proc.popen.wait(30) == 0
    wait_for(lambda: not any(alive(p) for p in family), 10, "every process of the gateway gone")
