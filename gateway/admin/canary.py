"""Admin routes for the canary and for config reload (guarded like the rest of /admin)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.body import read_body
from gateway.canary.rollout import Canary, CanaryState, Phase
from gateway.errors import AdminError, NoCanary, UnknownAction

Handler = Callable[[Request], Awaitable[Response]]
Publish = Callable[[CanaryState], Awaitable[object]]
Reload = Callable[[str], Coroutine[Any, Any, dict[str, Any]]]  # raises AdminError when refused
ACTIONS = ("set", "promote", "rollback", "pause", "resume")
OPERATOR = ("who", "why")


def who(request: Request, body: dict[str, Any]) -> str:
    """The operator, as the request names itself, and where it came from."""
    name = str(body.get("who") or request.headers.get("x-operator") or "admin")[:64]
    host = request.client.host if request.client else "?"
    return f"{name}@{host}"


class CanaryAdmin:
    def __init__(self, canary: Canary, guard: Callable[[Handler], Handler],
                 reload: Reload, publish: Publish | None = None) -> None:
        """``publish`` shares a change with the other gateway processes (through Redis)."""
        self._canary = canary
        self._guard = guard
        self._reload = reload
        self._publish = publish

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
            raise NoCanary("no canary configured ([canary] enabled = false)")
        if action not in ACTIONS:
            raise UnknownAction(f"unknown canary action {action!r}")
        body = await read_body(request, *OPERATOR, *(("group", "weight") if action == "set"
                                                     else ()))
        operator, why = who(request, body), str(body.get("why") or "")[:500]
        changes: dict[str, Any]
        if action == "set":
            group, weight = body.get("group"), body.get("weight")
            if group not in (canary.group, canary.stable) or weight is None:
                raise AdminError(f"give 'group' ({canary.stable} or {canary.group}) and "
                                 "'weight' (0-100)")
            weight = float(weight) if group == canary.group else 100.0 - float(weight)
            changes = {"weight": weight, "phase": Phase.MANUAL, "step": -1}
        elif action == "promote":
            changes = {"weight": 100.0, "phase": Phase.PROMOTED}
        elif action == "rollback":
            changes = {"weight": 0.0, "phase": Phase.ROLLED_BACK}
        else:
            changes = {"paused": action == "pause"}
            if action == "resume" and canary.settings.rollout.enabled and (
                    canary.state.phase is Phase.MANUAL):
                steps = canary.settings.rollout.steps
                changes.update(phase=Phase.ROLLING, step=max(
                    [i for i, s in enumerate(steps) if s <= canary.state.weight] or [0]))
        state = canary.change(operator, why or action, **changes)
        shared = await self._publish(state) if self._publish is not None else False
        return JSONResponse({"state": state.to_dict(), "shared": bool(shared)})

    async def reload(self, request: Request) -> Response:
        return JSONResponse(await self._reload(who(request, await read_body(request, "who"))))
