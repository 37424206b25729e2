"""Every admin POST route answers a malformed body with a 4xx in the OpenAI error format, and
acts on nothing: a real gateway with a canary between two simulators."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Gateway, Sim, http_ok, wait_for

ADMIN = {"authorization": "Bearer admin-secret"}
CONFIG = """admin_key = "admin-secret"
[health]
interval = 0.3
rise = 1
[canary]
enabled = true
weight = 0
[[models]]
name = "llama"
groups = { stable = "llama-v1", canary = "llama-v2" }
"""
ROUTES = [
    *(f"/admin/backends/stable0/{verb}" for verb in ("drain", "restart", "stop", "start")),
    "/admin/rolling-restart",
    *(f"/admin/canary/{action}" for action in ("set", "promote", "rollback", "pause", "resume")),
    "/admin/reload",
]
BAD_BODIES: list[bytes] = [
    b"{not json",
    b"\xff\xfe",
    b"[1, 2]",
    b'"drain"',
    b'{"weight": "x"}',
    b'{"timeout": "soon"}',
    b'{"then": 5}',
    b'{"who": 5}',
    b'{"timeout": -1, "then": "none"}',
    b'{"then": "explode"}',
    b'{"group": "canary", "weight": 500}',
    b'{"group": ["canary"], "weight": 5}',
]


@pytest.fixture(scope="module")
def gw(tmp: Path) -> Iterator[Gateway]:
    stable, canary = Sim(tmp, "st", "--model", "llama-v1"), Sim(tmp, "ca", "--model", "llama-v2")
    backends = "".join(f'\n[[backends]]\nname = "{g}0"\nurl = "{s.url}"\ngroup = "{g}"\n'
                       for g, s in (("stable", stable), ("canary", canary)))
    gateway = Gateway(tmp, CONFIG + backends, name="admin-errors")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 10, "gateway ready")
    yield gateway
    gateway.stop()
    stable.stop()
    canary.stop()


def assert_openai_error(resp: httpx.Response) -> dict[str, Any]:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return error


def state(gw: Gateway) -> tuple[Any, ...]:
    backends = httpx.get(gw.url + "/admin/status", headers=ADMIN).json()["backends"]
    canary = httpx.get(gw.url + "/admin/canary", headers=ADMIN).json()["state"]
    return (tuple((b["name"], b["state"]) for b in backends),
            canary["weight"], canary["phase"], canary["paused"])


@pytest.mark.parametrize("route", ROUTES)
def test_a_malformed_body_is_a_4xx_openai_error_and_changes_nothing(
    gw: Gateway, route: str,
) -> None:
    before = state(gw)
    for body in BAD_BODIES:
        resp = httpx.post(gw.url + route, content=body, headers={
            **ADMIN, "content-type": "application/json"})
        error = assert_openai_error(resp)
        assert error["code"] == "invalid_request", (route, body, error)
    assert state(gw) == before
    assert "Traceback" not in gw.proc.output()


def test_a_bad_field_is_named_in_param(gw: Gateway) -> None:
    resp = httpx.post(gw.url + "/admin/backends/stable0/drain", json={"timeout": "soon"},
                      headers=ADMIN)
    assert assert_openai_error(resp)["param"] == "timeout"
    resp = httpx.post(gw.url + "/admin/canary/set", json={"group": "canary", "weight": "x"},
                      headers=ADMIN)
    assert assert_openai_error(resp)["param"] == "weight"


@pytest.mark.parametrize(("method", "path", "headers", "status", "code"), [
    ("GET", "/admin/status", {}, 401, "invalid_admin_key"),
    ("POST", "/admin/canary/set", {"authorization": "Bearer wrong"}, 401, "invalid_admin_key"),
    ("POST", "/admin/backends/nope/drain", ADMIN, 404, "backend_not_found"),
    ("POST", "/admin/backends/stable0/restart", ADMIN, 400, "not_spawned"),
    ("POST", "/admin/canary/explode", ADMIN, 404, "not_found"),
    ("POST", "/admin/canary/set", ADMIN, 400, "invalid_request"),  # no group, no weight
])
def test_each_refusal_is_an_openai_error_with_its_code(
    gw: Gateway, method: str, path: str, headers: dict[str, str], status: int, code: str,
) -> None:
    resp = httpx.request(method, gw.url + path, headers=headers)
    assert resp.status_code == status
    error = assert_openai_error(resp)
    assert error["code"] == code and error["type"] == "admin_error"


def test_well_formed_bodies_still_act(gw: Gateway) -> None:
    changed = httpx.post(gw.url + "/admin/canary/set", headers=ADMIN,
                         json={"group": "canary", "weight": 10, "why": "ok", "who": None})
    assert changed.status_code == 200, changed.text
    assert changed.json()["state"]["weight"] == 10
    drained = httpx.post(gw.url + "/admin/backends/canary0/drain", headers=ADMIN,
                         json={"then": "none", "timeout": 0})
    assert drained.status_code == 200 and drained.json()["drained"] is True
    started = httpx.post(gw.url + "/admin/backends/canary0/start", headers=ADMIN)
    assert started.status_code == 200, started.text
