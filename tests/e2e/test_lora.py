"""LoRA adapters (issue 41) with spawned simulators that serve vLLM's runtime adapter
routes: an adapter is listed like a model, loaded on the instance a request goes to the
first time (once, however many requests ask at once), kept there while it has room, and
loaded again after that instance restarts; an adapter nobody declared is never loaded."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_supervision import spawned, status, supervisor_toml
from tests.helpers import Gateway, metric, wait_for

SIM_LORA = ('["{python}", "-m", "gateway", "sim", "--port", "{port}", "--model", '
            '"{served_model_name}", "--enable-lora", "--max-loras", "2", '
            '"--lora-load-delay", "0.3"]')


def adapter(tmp: Path, name: str) -> str:
    where = tmp / "adapters" / name
    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    return f'\n[[adapters]]\nname = "{name}"\nbase = "sim-model"\npath = "{where}"\n'


def ask(gw: Gateway, model: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "the same question"}]})


def sim(gw: Gateway, name: str, path: str) -> Any:
    port = next(b for b in status(gw).values() if b["name"] == name)["url"].rsplit(":", 1)[1]
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).json()


def page(gw: Gateway) -> dict[str, Any]:
    """Each backend's adapters, as the status page shows them."""
    data = httpx.get(gw.url + "/dashboard/data", timeout=5).json()
    return {b["name"]: b["adapters"] for b in data["backends"]}


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    config = (supervisor_toml(tmp_path) + adapter(tmp_path, "a1") + adapter(tmp_path, "a2")
              + adapter(tmp_path, "gone") + spawned("s1", SIM_LORA) + spawned("s2", SIM_LORA))
    gateway = Gateway(tmp_path, config, name="lora")
    try:
        wait_for(lambda: all(b["state"] == "ready" for b in status(gateway).values()), 30,
                 "both spawned simulators ready")
        yield gateway
    finally:
        gateway.stop()


def test_an_adapter_is_listed_loaded_where_it_goes_and_answers_as_itself(gw: Gateway) -> None:
    listed = {m["id"]: m for m in httpx.get(gw.url + "/v1/models").json()["data"]}
    assert set(listed) == {"sim-model", "a1", "a2", "gone"}
    assert listed["a1"]["parent"] == "sim-model"
    assert listed["a1"]["root"].endswith("adapters/a1")
    base, first = ask(gw, "sim-model"), ask(gw, "a1")
    assert first.status_code == 200 and first.json()["model"] == "a1"
    where = first.headers["x-gateway-backend"]
    other = ({"s1", "s2"} - {where}).pop()
    assert "a1" in {m["id"] for m in sim(gw, where, "/v1/models")["data"]}
    assert "a1" not in {m["id"] for m in sim(gw, other, "/v1/models")["data"]}
    second = ask(gw, "a2")
    texts = {r.json()["choices"][0]["message"]["content"] for r in (base, first, second)}
    assert len(texts) == 3  # the base model and each adapter answer differently
    assert metric(gw.url, "gateway_adapter_loads_total", backend=where, adapter="a1",
                  result="loaded") == 1
    again = [ask(gw, "a1") for _ in range(6)]  # where it is loaded, while it has room
    assert {r.headers["x-gateway-backend"] for r in again} == {where}
    assert {r.json()["choices"][0]["message"]["content"] for r in again} == {
        first.json()["choices"][0]["message"]["content"]}
    # The status page: each instance's adapters, as its /v1/models and metrics say.
    wait_for(lambda: "a1" in page(gw)[where]["loaded"], 10, "a1 on the status page")
    assert page(gw)[where]["slots"] == 2 and "a1" not in page(gw)[other]["loaded"]


def test_requests_at_once_load_an_adapter_once(gw: Gateway) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: ask(gw, "a2"), range(8)))
    assert {r.status_code for r in replies} == {200}
    served = {r.headers["x-gateway-backend"] for r in replies}
    loads = {name: sim(gw, name, "/sim/stats")["lora_loads"] for name in ("s1", "s2")}
    assert loads == {name: int(name in served) for name in loads}  # one load where it went


def test_an_instance_restarted_loads_the_adapter_again_on_demand(gw: Gateway) -> None:
    first = ask(gw, "a1")
    where = first.headers["x-gateway-backend"]
    pid = status(gw)[where]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: status(gw)[where]["pid"] not in (None, pid)
             and status(gw)[where]["state"] == "ready", 30, "restarted and ready")
    replies = [ask(gw, "a1") for _ in range(4)]
    assert {r.status_code for r in replies} == {200}
    assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {
        first.json()["choices"][0]["message"]["content"]}


def test_an_adapter_nobody_declared_is_a_missing_model_and_never_loaded(gw: Gateway) -> None:
    for name in ("a3", "../../etc", "/tmp/adapters/a1"):
        reply = ask(gw, name)
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["code"] == "model_not_found"
    assert sum(sim(gw, n, "/sim/stats")["lora_loads"] for n in ("s1", "s2")) == 0


def test_an_adapter_vllm_refuses_gets_a_503_and_opens_no_breaker(gw: Gateway,
                                                                 tmp_path: Path) -> None:
    (tmp_path / "adapters" / "gone" / "adapter_config.json").unlink()  # after the check
    for _ in range(12):  # more than the breakers' 5 failures in a row, on both instances
        reply = ask(gw, "gone")
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "adapter_unavailable"
    assert {b["breaker"]["state"] if isinstance(b["breaker"], dict) else b["breaker"]
            for b in status(gw).values()} == {"closed"}
    assert {ask(gw, "sim-model").status_code for _ in range(4)} == {200}
    assert metric(gw.url, "gateway_adapter_loads_total", result="refused") >= 1


def listed(gw: Gateway, name: str) -> set[str]:
    return {m["id"] for m in sim(gw, name, "/v1/models")["data"]}


def test_an_adapter_a_reload_removes_is_refused_and_unloaded(gw: Gateway) -> None:
    first = ask(gw, "a1")
    assert first.status_code == 200
    where = first.headers["x-gateway-backend"]
    assert "a1" in listed(gw, where)
    text = gw.config_path.read_text()
    gw.config_path.write_text(text.replace('\n[[adapters]]\nname = "a1"', '\n[[adapters]]\n'
                                           'name = "a9"', 1))
    assert httpx.post(gw.url + "/admin/reload", json={"who": "test"},
                      timeout=30).status_code == 200
    reply = ask(gw, "a1")  # still listed by its instance, but no longer declared
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert "a1" not in {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}
    wait_for(lambda: "a1" not in listed(gw, where), 20, "a1 unloaded from its instance")
    assert metric(gw.url, "gateway_adapter_unloads_total", backend=where, adapter="a1",
                  result="unloaded") >= 1
    assert ask(gw, "a2").status_code == 200  # the others as before


def test_a_preloaded_adapter_is_on_every_instance_before_any_request(tmp_path: Path) -> None:
    config = (supervisor_toml(tmp_path) + adapter(tmp_path, "p1") + "preload = true\n"
              + adapter(tmp_path, "p2") + spawned("s1", SIM_LORA) + spawned("s2", SIM_LORA))
    gateway = Gateway(tmp_path, config, name="lora-preload")
    try:
        wait_for(lambda: all("p1" in listed(gateway, n) for n in ("s1", "s2")), 40,
                 "p1 loaded on both instances")
        assert not any("p2" in listed(gateway, n) for n in ("s1", "s2"))  # on demand only
        assert ask(gateway, "p1").status_code == 200
    finally:
        gateway.stop()


def test_a_models_alias_of_an_adapter_routes_loads_and_answers_as_the_adapter(
        tmp_path: Path) -> None:
    """``[[models]]`` maps a name clients use to an adapter (per group, as a canary would
    map it to the adapter's next version): it is loaded, answered by, and listed under
    the alias."""
    config = (supervisor_toml(tmp_path) + adapter(tmp_path, "a1")
              + '\n[[models]]\nname = "support"\ngroups = { stable = "a1" }\n'
              + spawned("s1", SIM_LORA))
    gateway = Gateway(tmp_path, config, name="lora-alias")
    try:
        wait_for(lambda: status(gateway)["s1"]["state"] == "ready", 30, "s1 ready")
        cards = {m["id"]: m for m in httpx.get(gateway.url + "/v1/models").json()["data"]}
        assert cards["support"]["parent"] == "sim-model"
        aliased = ask(gateway, "support")
        assert aliased.status_code == 200, aliased.text
        assert aliased.json()["model"] == "support"
        assert "a1" in listed(gateway, "s1")
        assert aliased.json()["choices"][0]["message"]["content"] == \
            ask(gateway, "a1").json()["choices"][0]["message"]["content"] != \
            ask(gateway, "sim-model").json()["choices"][0]["message"]["content"]
    finally:
        gateway.stop()
