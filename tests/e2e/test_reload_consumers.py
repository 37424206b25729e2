"""A reload reaches every part that uses what it changes: one owner, no stale copies.

Each backend simulator serves exactly one name and answers 404 for any other (as vLLM
does), so a body sent upstream with a stale served name fails visibly.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, metric, wait_for

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[dict[str, Sim]]:
    out = {name: Sim(tmp, name, "--model", served, "--tokens", "4", "--ttft", "0",
                     "--itl", "0")
           for name, served in (("s1", "old-served"), ("s2", "new-served"),
                                ("c1", "canary-served"))}
    yield out
    for sim in out.values():
        sim.stop()


def config(sims: dict[str, Sim], before: bool) -> str:
    common = '[health]\ninterval = 0.2\nrise = 1\n[breaker]\nenabled = false\n'
    if before:
        return (common + backend_toml("s1", sims["s1"].url)
                + '[[models]]\nname = "llama"\ngroups = { stable = "old-served" }\n')
    return (common + backend_toml("s1", sims["s1"].url) + backend_toml("s2", sims["s2"].url)
            + backend_toml("c1", sims["c1"].url, 'group = "canary"')
            + '[[models]]\nname = "llama"\n'
              'groups = { stable = "new-served", canary = "canary-served" }\n'
            + '[canary]\nenabled = true\nweight = 0\nshadow = 100\nsync_interval = 0.05\n')


def test_every_reloadable_section_reaches_each_of_its_consumers(
        tmp: Path, sims: dict[str, Sim]) -> None:
    gw = Gateway(tmp, config(sims, before=True), name="reload-consumers")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="llama", **CHAT).model == "llama"

        text = gw.config_path.read_text()
        gw.config_path.write_text(text.split("[health]")[0] + config(sims, before=False))
        gw.proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded by SIGHUP" in gw.proc.output(), 10, "the reload")
        wait_for(lambda: httpx.get(gw.url + "/readyz").json()["backends"].get("s2") == "ready",
                 10, "s2 probed ready")

        # [[models]] -> the pool's routing, the body sent upstream, the reply rewrite.
        raw = httpx.post(gw.url + "/v1/chat/completions", json={"model": "llama", **CHAT})
        assert raw.status_code == 200, raw.text
        assert raw.headers["x-gateway-backend"] == "s2"
        assert raw.json()["model"] == "llama"
        assert int(raw.headers["content-length"]) == len(raw.content)
        stream = client.chat.completions.create(model="llama", stream=True, **CHAT)
        assert {chunk.model for chunk in stream} == {"llama"}
        # ... and /v1/models, by the client's name (s1 still serves its own, unmapped, name).
        assert sorted(m.id for m in client.models.list()) == ["llama", "old-served"]

        # [canary] -> the shadow mirror (new group, its own served name) and its settings.
        before = sims["c1"].stats()["completed"]
        client.chat.completions.create(model="llama", **CHAT)
        wait_for(lambda: sims["c1"].stats()["completed"] > before, 10,
                 "the shadow copy answered by the canary under its own name")
        assert metric(gw.url, "gateway_shadow_requests_total", outcome="ok") >= 1
        canary = httpx.get(gw.url + "/admin/canary").json()
        assert canary["enabled"] is True and canary["shadow"] == 100

        # [[backends]] -> health checks, status page, admin view and readiness.
        status = httpx.get(gw.url + "/admin/status").json()
        names = {b["name"] for b in status["backends"]}
        assert names == {"s1", "s2", "c1"}
        page = httpx.get(gw.url + "/dashboard/data").json()
        assert {b["name"] for b in page["backends"]} == names
        assert set(httpx.get(gw.url + "/readyz").json()["backends"]) == names
    finally:
        gw.stop()
