"""Admin routes for the canary and for config reload (guarded like the rest of /admin)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.canary.rollout import Canary, CanaryState

Handler = Callable[[Request], Awaitable[Response]]
Publish = Callable[[CanaryState], Awaitable[object]]
Reload = Callable[[str], Awaitable[tuple[bool, dict[str, Any]]]]


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "admin_error", "param": None,
                                   "code": code}}, status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    if not await request.body():
        return {}
    data = await request.json()
    return data if isinstance(data, dict) else {}


def who(request: Request, body: dict[str, Any]) -> str:
    """The operator, as the request names itself, and where it came from."""
    name = str(body.get("who") or request.headers.get("x-operator") or "admin")[:64]
    host = request.client.host if request.client else "?"
    return f"{name}@{host}"


class CanaryAdmin:
    def __init__(self, canary: Canary, guard: Callable[[Handler], Handler],
                 reload: Reload) -> None:
        self._canary = canary
        self._guard = guard
        self._reload = reload
        self.publish: Publish | None = None  # set once Redis is up

    def routes(self) -> list[Route]:
        g = self._guard
        return [
            Route("/admin/canary", g(self.status), methods=["GET"]),
            Route("/admin/canary/{action}", g(self.act), methods=["POST"]),
            Route("/admin/reload", g(self.reload), methods=["POST"]),
        ]

    async def status(self, request: Request) -> Response:
        return JSONResponse(self._canary.status())

    async def act(self, request: Request) -> Response:
        canary, action = self._canary, request.path_params["action"]
        if not canary.enabled:
            return _error(409, "no canary configured ([canary] enabled = false)", "no_canary")
        body = await _body(request)
        operator, why = who(request, body), str(body.get("why") or "")[:500]
        changes: dict[str, Any]
        if action == "set":
            group, weight = body.get("group"), body.get("weight")
            if group not in (canary.group, canary.stable) or not isinstance(
                    weight, int | float) or not 0 <= weight <= 100:
                return _error(400, f"give 'group' ({canary.stable} or {canary.group}) and "
                                   "'weight' (0-100)", "invalid_request")
            weight = float(weight) if group == canary.group else 100.0 - float(weight)
            changes = {"weight": weight, "phase": "manual", "step": -1}
        elif action == "promote":
            changes = {"weight": 100.0, "phase": "promoted"}
        elif action == "rollback":
            changes = {"weight": 0.0, "phase": "rolled_back"}
        elif action in ("pause", "resume"):
            changes = {"paused": action == "pause"}
            if action == "resume" and canary.settings.rollout.enabled and (
                    canary.state.phase == "manual"):
                steps = canary.settings.rollout.steps
                changes.update(phase="rolling", step=max(
                    [i for i, s in enumerate(steps) if s <= canary.state.weight] or [0]))
        else:
            return _error(404, f"unknown canary action {action!r}", "not_found")
        state = canary.change(operator, why or action, **changes)
        shared = await self.publish(state) if self.publish is not None else False
        return JSONResponse({"state": state.to_dict(), "shared": bool(shared)})

    async def reload(self, request: Request) -> Response:
        ok, result = await self._reload(who(request, await _body(request)))
        return JSONResponse(result, status_code=200 if ok else 400)
