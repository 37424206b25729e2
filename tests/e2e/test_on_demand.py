"""Spawned instances started and stopped by demand (issue 39), with simulators as the
spawned command, real processes, one serving process and a control process with two
workers: an on-demand instance is not running until its model's first request, which
waits for it (streams too) instead of a 503; several at once start it once; idle for
``stop_after``, it is stopped, and the next request starts it again."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_supervision import SIM, alive, chat, spawned, status, supervisor_toml
from tests.helpers import Gateway, http_ok, wait_for


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "control-and-workers"])
def test_an_on_demand_instance_starts_for_its_first_requests_and_stops_when_idle(
        tmp_path: Path, workers: int) -> None:
    config = supervisor_toml(tmp_path) + spawned(
        "lazy", SIM, 'start = "on_demand"\nstop_after = 2\nwake_timeout = 20')
    gw = Gateway(tmp_path, config, name=f"demand-{workers}", workers=workers)
    try:
        wait_for(lambda: http_ok(gw.url + "/admin/status"), 20, "gateway up")
        assert status(gw)["lazy"]["state"] == "stopped"  # not started at boot
        assert status(gw)["lazy"]["pid"] is None
        listed = httpx.get(gw.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["sim-model"]  # listed before it ever ran
        assert httpx.get(gw.url + "/health").status_code == 200  # it can serve: by starting
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the first ones, at once
            answers = list(pool.map(lambda _: chat(gw), range(4)))
        assert {a.http_response.status_code for a in answers} == {200}
        wait_for(lambda: status(gw)["lazy"]["state"] == "ready", 5, "ready in every view")
        first = status(gw)["lazy"]
        assert first["pid"] is not None
        wait_for(lambda: status(gw)["lazy"]["state"] == "stopped", 20,
                 "stopped after 2 s without a request")
        assert not alive(first["pid"])
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(  # a stream waits for the start too
            model="sim-model", max_tokens=3, stream=True,
            messages=[{"role": "user", "content": "again"}])
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) == 3
        # Every worker sees it ready within a sync (the one that served it already did).
        wait_for(lambda: status(gw)["lazy"]["state"] == "ready", 5, "ready in every view")
        assert status(gw)["lazy"]["pid"] not in (None, first["pid"])
    finally:
        gw.stop()


def test_a_request_that_waits_longer_than_wake_timeout_gets_a_503_with_retry_after(
        tmp_path: Path) -> None:
    never = '["sh", "-c", "sleep 60"]'  # never answers: the start outlasts the wait
    config = supervisor_toml(tmp_path) + spawned(
        "slow", never, 'start = "on_demand"\nwake_timeout = 1')
    gw = Gateway(tmp_path, config, name="demand-timeout")
    try:
        wait_for(lambda: http_ok(gw.url + "/admin/status"), 20, "gateway up")
        reply = httpx.post(gw.url + "/v1/chat/completions", timeout=20, json={
            "model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503 and "retry-after" in reply.headers
        assert reply.json()["error"]["code"] == "no_backend_available"
        assert status(gw)["slow"]["state"] == "starting"  # asked for, still coming
    finally:
        gw.stop()


def test_a_reload_does_not_start_an_on_demand_instance(tmp_path: Path) -> None:
    """A reload that changes an on-demand backend (a new spec: a new supervisor) keeps it
    stopped until its model is asked for, as at boot."""
    config = supervisor_toml(tmp_path) + spawned(
        "lazy", SIM, 'start = "on_demand"\nstop_after = 30\nwake_timeout = 20')
    gw = Gateway(tmp_path, config, name="demand-reload")
    try:
        wait_for(lambda: http_ok(gw.url + "/admin/status"), 20, "gateway up")
        gw.config_path.write_text(gw.config_path.read_text().replace(
            "stop_after = 30", "stop_after = 40"))
        reply = httpx.post(gw.url + "/admin/reload", json={"who": "test"}, timeout=30)
        assert reply.status_code == 200 and reply.json()["added"] == ["lazy"]
        wait_for(lambda: status(gw)["lazy"]["state"] == "stopped", 5, "stopped after reload")
        assert status(gw)["lazy"]["pid"] is None
        assert chat(gw).http_response.status_code == 200  # and started when asked for
    finally:
        gw.stop()
