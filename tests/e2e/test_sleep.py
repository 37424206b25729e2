"""Sleep mode driven by the gateway (issue 39), with simulators that serve vLLM's sleep
routes as the spawned command, real processes: idle for ``sleep_after``, an instance is
put to sleep (its model still listed, probes do not wake it); the next requests (several at
once, a stream among them) wake it once and wait for it; each wake is checked against the
answer the instance gave before its first sleep, and an instance whose answers changed (the
simulator's ``--wake-garbles``) is restarted cold; level 2 reloads the weights before the
cache wakes; the admin verbs sleep and wake work."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_supervision import chat, spawned, status, supervisor_toml
from tests.helpers import Gateway, free_port, http_ok, wait_for

SLEEPY = ('["{python}", "-m", "gateway", "sim", "--port", "{port}", "--model", '
          '"{served_model_name}", "--enable-sleep-mode", "--wake-delay", "0.3"%s]')


def sleepy(name: str, port: int, extra: str = "", faults: str = "") -> str:
    return spawned(name, SLEEPY % faults, f"sleep_after = 1\nwake_timeout = 20\n{extra}", port)


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def is_sleeping(port: int) -> bool:
    return bool(httpx.get(f"http://127.0.0.1:{port}/is_sleeping").json()["is_sleeping"])


def answer(gw: Gateway) -> str:
    reply = httpx.post(gw.url + "/v1/completions", timeout=30, json={
        "model": "sim-model", "prompt": "The same prompt", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("level", [1, 2])
def test_an_idle_instance_sleeps_and_the_next_requests_wake_it_once(
        tmp_path: Path, level: int) -> None:
    port = free_port()
    gw = Gateway(tmp_path, supervisor_toml(tmp_path) + sleepy("s", port, f"sleep_level = {level}"),
                 name=f"sleep-{level}", workers=2)
    try:
        wait_for(lambda: http_ok(gw.url + "/v1/models"), 30, "instance ready")
        first = answer(gw)
        # Each worker shows the control process's states after its next sync: four reads in a
        # row (new connections, any worker) that agree.
        wait_for(lambda: all((s := status(gw)["s"])["state"] == "asleep"
                             and s["sleep_level"] == level for _ in range(4)), 20,
                 "asleep after 1 s idle, in every worker's view")
        assert is_sleeping(port)
        pid = status(gw)["s"]["pid"]
        models = httpx.get(gw.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["sim-model"]  # a sleeping model is still listed
        assert httpx.get(gw.url + "/health").status_code == 200
        assert status(gw)["s"]["state"] == "asleep"  # probes and listings woke nothing
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: chat(gw), range(4)))
        assert {r.http_response.status_code for r in replies} == {200}
        assert answer(gw) == first  # the same answers after the wake
        assert status(gw)["s"]["pid"] == pid  # woken, not restarted
        # Counted by the control process, shown by any worker after its next sync.
        wait_for(lambda: metric(gw, "gateway_backend_wake_checks_total", result="ok") == 1, 5,
                 "one wake counted")
        assert metric(gw, "gateway_backend_transitions_total", **{"from": "asleep"}) == 1
        wait_for(lambda: status(gw)["s"]["state"] == "asleep", 20, "asleep again")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(  # a stream waits for the wake too
            model="sim-model", max_tokens=3, stream=True,
            messages=[{"role": "user", "content": "again"}])
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 3
        wait_for(lambda: metric(gw, "gateway_backend_wake_checks_total", result="ok") == 2, 5,
                 "the second wake counted")
        assert metric(gw, "gateway_backend_transitions_total", to="asleep") == 2
    finally:
        gw.stop()


def test_an_instance_whose_answers_change_after_a_wake_is_restarted_cold(
        tmp_path: Path) -> None:
    port = free_port()
    config = supervisor_toml(tmp_path) + sleepy("g", port, faults=', "--wake-garbles"')
    gw = Gateway(tmp_path, config, name="sleep-garbles")
    try:
        wait_for(lambda: http_ok(gw.url + "/v1/models"), 30, "instance ready")
        first, pid = answer(gw), status(gw)["g"]["pid"]
        wait_for(lambda: status(gw)["g"]["state"] == "asleep", 20, "asleep after 1 s idle")
        assert answer(gw) == first  # waited through the wake, the check and the restart
        assert status(gw)["g"]["pid"] != pid  # restarted cold
        assert metric(gw, "gateway_backend_wake_checks_total", result="wrong_answer") == 1
        assert metric(gw, "gateway_backend_wake_checks_total", result="ok") == 0
    finally:
        gw.stop()


def test_the_admin_verbs_sleep_and_wake(tmp_path: Path) -> None:
    port = free_port()
    config = supervisor_toml(tmp_path) + sleepy("s", port).replace(
        "sleep_after = 1", "sleep_after = 600")
    gw = Gateway(tmp_path, config, name="sleep-admin")
    try:
        wait_for(lambda: http_ok(gw.url + "/v1/models"), 30, "instance ready")
        answer(gw)
        wait_for(lambda: metric(gw, "gateway_backend_transitions_total", to="ready") >= 1, 10,
                 "first ready seen")
        slept = httpx.post(gw.url + "/admin/backends/s/sleep", timeout=30).json()
        assert slept == {"backend": "s", "ok": True, "state": "asleep"} and is_sleeping(port)
        woke = httpx.post(gw.url + "/admin/backends/s/wake", timeout=30).json()
        assert woke == {"backend": "s", "ok": True, "state": "ready"} and not is_sleeping(port)
        refused = httpx.post(gw.url + "/admin/backends/s/wake", timeout=30).json()
        assert refused["ok"] is False  # awake already
    finally:
        gw.stop()
