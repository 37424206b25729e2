"""The admin verbs alone (issue 37): the /admin routes of a gateway built by
``gateway.build`` (in-memory backends, in-memory Redis link where one is shared), called as
an ASGI app through httpx's ``ASGITransport``: no socket, no process. Each malformed body is
a 4xx in the OpenAI error format that changes nothing; each refusal has its code; the
backend verbs (status, drain, start, and the spawned-only ones), the canary verbs (set,
promote, rollback, pause, resume: applied here and published for the other processes) and
the config reload (keys applied at once, an invalid file refused, the config kept)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayApp
from gateway.build import build
from gateway.config import load
from tests.factories import config
from tests.fakes import FakeUpstream, always, call, completion, held
from tests.memlink import MemoryLink, built_with

ADMIN = {"authorization": "Bearer admin-secret"}
STABLE, CANARY = "http://stable.test:8000", "http://canary.test:8000"
SECTIONS: dict[str, Any] = {
    "gateway": {"admin_key": "admin-secret", "workers": 1},
    "canary": {"enabled": True, "weight": 0},
    "models": [{"name": "llama", "groups": {"stable": "llama-v1", "canary": "llama-v2"}}],
    "backends": [{"name": "stable0", "url": STABLE, "group": "stable"},
                 {"name": "canary0", "url": CANARY, "group": "canary"}],
    "routing": {"sticky": False}, "breaker": {"share": False}, "degraded": {"cache": False},
}
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
Admin = Callable[[httpx.AsyncClient, GatewayApp], Awaitable[None]]


def gateway(upstream: FakeUpstream | None = None, path: str | None = None,
            **sections: Any) -> GatewayApp:
    """A gateway with a stable and a canary backend, both ready; its admin key is set."""
    cfg = config(**{**SECTIONS, **sections})
    upstream = upstream or FakeUpstream({STABLE: always(completion(model="llama-v1")),
                                         CANARY: always(completion(model="llama-v2"))})
    app = GatewayApp(cfg, parts=build(cfg, path, upstream=upstream))
    for backend in app.parts.pool.backends:
        backend.mark_ready()
        backend.learn(frozenset({f"llama-v{1 if backend.spec.group == 'stable' else 2}"}),
                      None)
    return app


def drive(app: GatewayApp, body: Admin) -> None:
    """Run ``body`` with an HTTP client on ``app`` (as from loopback)."""
    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            await body(client, app)

    asyncio.run(asyncio.wait_for(main(), 10))


def assert_openai_error(resp: httpx.Response) -> dict[str, Any]:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return error


async def state(client: httpx.AsyncClient) -> tuple[Any, ...]:
    backends = (await client.get("/admin/status", headers=ADMIN)).json()["backends"]
    canary = (await client.get("/admin/canary", headers=ADMIN)).json()["state"]
    return (tuple((b["name"], b["state"]) for b in backends),
            canary["weight"], canary["phase"], canary["paused"])


def test_a_malformed_body_is_a_4xx_openai_error_and_changes_nothing() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        before = await state(client)
        for route in ROUTES:
            for bad in BAD_BODIES:
                resp = await client.post(route, content=bad, headers={
                    **ADMIN, "content-type": "application/json"})
                error = assert_openai_error(resp)
                assert error["code"] == "invalid_request", (route, bad, error)
        assert await state(client) == before

    drive(gateway(), body)


def test_a_bad_field_is_named_in_param() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        resp = await client.post("/admin/backends/stable0/drain", json={"timeout": "soon"},
                                 headers=ADMIN)
        assert assert_openai_error(resp)["param"] == "timeout"
        resp = await client.post("/admin/canary/set", json={"group": "canary", "weight": "x"},
                                 headers=ADMIN)
        assert assert_openai_error(resp)["param"] == "weight"
        resp = await client.post("/admin/reload", json={"why": "x"}, headers=ADMIN)
        error = assert_openai_error(resp)
        assert error["param"] == "why" and "this route takes 'who'" in error["message"]

    drive(gateway(), body)


@pytest.mark.parametrize(("method", "path", "headers", "content", "status", "code"), [
    ("GET", "/admin/status", {}, None, 401, "invalid_admin_key"),
    ("POST", "/admin/canary/set", {"authorization": "Bearer wrong"}, None, 401,
     "invalid_admin_key"),
    ("GET", "/admin/keys", {"authorization": "Basic admin-secret"}, None, 401,
     "invalid_admin_key"),
    ("POST", "/admin/backends/nope/drain", ADMIN, None, 404, "backend_not_found"),
    ("POST", "/admin/backends/stable0/restart", ADMIN, None, 400, "not_spawned"),
    ("POST", "/admin/backends/stable0/stop", ADMIN, None, 400, "not_spawned"),
    ("POST", "/admin/backends/stable0/drain", ADMIN, b'{"then": "restart"}', 400,
     "not_spawned"),
    ("POST", "/admin/canary/explode", ADMIN, None, 404, "not_found"),
    ("POST", "/admin/canary/set", ADMIN, None, 400, "invalid_request"),  # no group, weight
])
def test_each_refusal_is_an_openai_error_with_its_code_and_changes_nothing(
    method: str, path: str, headers: dict[str, str], content: bytes | None, status: int,
    code: str,
) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        before = await state(client)
        resp = await client.request(method, path, headers=headers, content=content)
        assert resp.status_code == status
        error = assert_openai_error(resp)
        assert error["code"] == code and error["type"] == "admin_error"
        assert await state(client) == before

    drive(gateway(), body)


def test_refused_admin_keys_are_counted_and_without_a_key_only_loopback_may_act() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        assert (await client.get("/admin/status")).status_code == 200  # from 127.0.0.1
        away = httpx.ASGITransport(app=app, client=("10.0.0.9", 5000))
        async with httpx.AsyncClient(transport=away, base_url="http://gw") as remote:
            resp = await remote.post("/admin/canary/promote")
        assert resp.status_code == 401
        assert app.parts.canary.state.weight == 0

    drive(gateway(gateway={"workers": 1}), body)
    keyed = gateway()

    async def refused(client: httpx.AsyncClient, app: GatewayApp) -> None:
        await client.get("/admin/status")
        await client.get("/admin/status", headers={"authorization": "Bearer nope"})
        assert (await client.get("/admin/status", headers=ADMIN)).status_code == 200

    drive(keyed, refused)
    failures = keyed.parts.metrics.auth_failures
    assert sum(s.value for s in next(iter(failures.collect())).samples
               if s.name.endswith("_total")) == 2


def test_status_lists_each_backend_and_drain_takes_one_out_until_started() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        listed = (await client.get("/admin/status", headers=ADMIN)).json()["backends"]
        assert [(b["name"], b["group"], b["state"], b["spawned"], b["in_flight"])
                for b in listed] == [("stable0", "stable", "ready", False, 0),
                                     ("canary0", "canary", "ready", False, 0)]
        assert listed[0]["models"] == ["llama-v1"] and listed[0]["url"] == STABLE
        drained = await client.post("/admin/backends/canary0/drain", headers=ADMIN,
                                    json={"then": "none", "timeout": 0})
        assert drained.status_code == 200
        assert drained.json() == {"backend": "canary0", "drained": True, "state": "draining"}
        assert not app.parts.pool.backends[1].routable
        started = await client.post("/admin/backends/canary0/start", headers=ADMIN)
        assert started.json() == {"backend": "canary0", "state": "starting"}  # probes decide

    drive(gateway(), body)


def test_a_drain_waits_for_the_requests_in_flight_within_its_timeout() -> None:
    release = asyncio.Event()
    upstream = FakeUpstream({STABLE: held(completion(model="llama-v1"), release)})
    app = gateway(upstream, canary={"enabled": False}, models=[],
                  backends=[{"name": "stable0", "url": STABLE}])
    ask = {"model": "llama-v1", "messages": [{"role": "user", "content": "hi"}]}

    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        going = asyncio.create_task(call(app, ask))
        while not upstream.sent:  # noqa: ASYNC110 (the fake's own record)
            await asyncio.sleep(0)
        short = await client.post("/admin/backends/stable0/drain", headers=ADMIN,
                                  json={"timeout": 0.05})
        assert short.json() == {"backend": "stable0", "drained": False, "state": "draining"}
        refused = await call(app, ask)  # out of rotation: nothing else to take it
        assert refused.status == 503
        waiting = asyncio.create_task(client.post("/admin/backends/stable0/drain",
                                                  headers=ADMIN, json={"timeout": 5}))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        release.set()
        assert (await going).status == 200
        assert (await waiting).json()["drained"] is True

    drive(app, body)


def test_rolling_restart_with_nothing_spawned_restarts_nothing() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        resp = await client.post("/admin/rolling-restart", headers=ADMIN)
        assert resp.status_code == 200 and resp.json() == {"results": [], "aborted": False}

    drive(gateway(), body)


def test_canary_verbs_change_the_state_and_name_the_operator() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        async def act(action: str, **fields: Any) -> dict[str, Any]:
            resp = await client.post(f"/admin/canary/{action}", headers={
                **ADMIN, "x-operator": "ops"}, json=fields or None)
            assert resp.status_code == 200, resp.text
            assert resp.json()["shared"] is False  # no Redis: this process only
            result: dict[str, Any] = resp.json()["state"]
            return result

        first = await act("set", group="canary", weight=10, why="try it")
        assert (first["weight"], first["phase"], first["by"], first["why"]) == (
            10, "manual", "ops@127.0.0.1", "try it")
        assert (await act("set", group="stable", weight=75, who="alice"))["weight"] == 25
        assert (await act("pause"))["paused"] is True
        assert (await act("resume"))["paused"] is False
        promoted = await act("promote")
        assert (promoted["weight"], promoted["phase"]) == (100, "promoted")
        rolled = await act("rollback", why="errors")
        assert (rolled["weight"], rolled["phase"], rolled["why"]) == (0, "rolled_back", "errors")
        assert rolled["version"] > promoted["version"] > first["version"]
        shown = (await client.get("/admin/canary", headers=ADMIN)).json()
        assert shown["state"] == rolled and shown["canary"] == "canary"

    drive(gateway(), body)


def test_a_canary_verb_without_a_canary_is_refused() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        resp = await client.post("/admin/canary/promote", headers=ADMIN)
        error = assert_openai_error(resp)
        assert error["code"] == "no_canary"

    drive(gateway(canary={"enabled": False}), body)


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryLink]:
    memory = MemoryLink()
    built_with(memory, monkeypatch)
    yield memory


def test_a_canary_change_is_published_for_the_other_processes(link: MemoryLink) -> None:
    redis: dict[str, Any] = {"redis": {"url": "redis://127.0.0.1:1/0"}}

    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        resp = await client.post("/admin/canary/set", headers=ADMIN,
                                 json={"group": "canary", "weight": 30})
        assert resp.json()["shared"] is True
        stored = json.loads(link.run("GET", "vgw:canary:state"))
        assert stored["weight"] == 30 and stored["phase"] == "manual"
        other = gateway(**redis)  # another process, sharing the link
        assert other.parts.shared is not None
        await other.parts.shared.canary_sync.sync_once()
        assert other.parts.canary.state.weight == 30  # adopted
        link.down = True
        resp = await client.post("/admin/canary/promote", headers=ADMIN)
        assert resp.status_code == 200 and resp.json()["shared"] is False
        assert app.parts.canary.state.weight == 100  # applied here all the same

    drive(gateway(**redis), body)


RELOADABLE = """
[gateway]
admin_key = "admin-secret"
workers = 1
{api_keys}
[routing]
sticky = false
[breaker]
share = false
[degraded]
cache = false
[[backends]]
name = "stable0"
url = "{url}"
{keys}
"""


def toml(keys: dict[str, str], api_keys: tuple[str, ...] = ()) -> str:
    flat = f"api_keys = {json.dumps(list(api_keys))}" if api_keys else ""
    entries = "".join(f'[[keys]]\nname = "{n}"\nkey = "{k}"\n' for n, k in keys.items())
    return RELOADABLE.format(api_keys=flat, url=STABLE, keys=entries)


def test_a_reload_applies_new_keys_at_once_and_refuses_an_invalid_file(tmp_path: Path) -> None:
    """Rotating keys is a reload: a key taken out is refused at once, a new one and a flat
    api_keys entry are accepted, nothing asks for a restart; an invalid file changes
    nothing."""
    path = tmp_path / "gateway.toml"
    path.write_text(toml({"alice": "alice-secret-key-1", "bob": "bob-secret-key-22"}))
    cfg = load(str(path))
    upstream = FakeUpstream({STABLE: always(completion())})
    app = GatewayApp(cfg, parts=build(cfg, str(path), upstream=upstream))
    for backend in app.parts.pool.backends:
        backend.mark_ready()
        backend.learn(frozenset({"m"}), None)
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def chat(key: str) -> int:
        return (await call(app, ask, headers=[(b"authorization", f"Bearer {key}".encode())])
                ).status

    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        assert await chat("alice-secret-key-1") == 200
        dave = "dave-secret-key-4444"
        path.write_text(toml({"dave": dave, "bob": "bob-secret-key-22"},
                             ("flat-secret-key-55555",)))
        resp = await client.post("/admin/reload", headers=ADMIN, json={"who": "test"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"reloaded": True, "kept": ["stable0"], "added": [],
                               "removed": [], "needs_restart": []}
        assert await chat("alice-secret-key-1") == 401
        assert await chat(dave) == 200 and await chat("flat-secret-key-55555") == 200
        names = {k["name"] for k in (await client.get("/admin/keys", headers=ADMIN)
                                     ).json()["keys"]}
        assert names == {"api_keys.0", "dave", "bob"}
        path.write_text(path.read_text().replace("sticky = false", "sticky = 5"))
        refused = await client.post("/admin/reload", headers=ADMIN)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "invalid_config" and error["type"] == "invalid_config"
        assert [p.split(": ", 1)[1] for p in error["problems"]] == [
            "routing.sticky: Input should be a valid boolean, unable to interpret input"]
        assert await chat(dave) == 200  # the running config stays

    drive(app, body)


def test_a_reload_without_a_config_path_is_refused() -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp) -> None:
        error = assert_openai_error(await client.post("/admin/reload", headers=ADMIN))
        assert "config path" in error["message"]

    drive(gateway(), body)
