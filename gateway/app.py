"""The ASGI app: OpenAI POST routes go straight to the proxy, the rest to Starlette.

Every part comes from ``gateway.build``; ``gateway.lifespan`` starts and stops them. Nothing
imports this module except the CLI.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from importlib import resources
from pathlib import Path

import orjson
import yaml
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import __version__
from gateway.build import Parts, build
from gateway.config import CONFIG_ENV, CONFIG_TEXT_ENV, Config, load
from gateway.control.role import Role
from gateway.errors import StreamAborted, error_body
from gateway.http.asgi import request_id, send_json
from gateway.http.auth import ApiKeyAuth
from gateway.http.framing import Http10Framing
from gateway.lifespan import Lifespan
from gateway.observability import logs
from gateway.routing.responses import stored_route

# vLLM's POST routes that name a model in their JSON body, proxied alike (the audio routes'
# multipart bodies name it in a form field).
PROXIED = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
    "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/pooling", "/classify",
    "/v1/audio/transcriptions", "/v1/audio/translations",
})
VERSIONS_TTL = 5.0  # seconds /version keeps the backends' answers
STORED = "/v1/responses/"  # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel


class GatewayApp:
    """Routes only: the proxy for OpenAI POSTs, Starlette's router for everything else."""

    def __init__(self, config: Config, parts: Parts | None = None,
                 config_path: str | None = None) -> None:
        self.parts = parts = parts or build(config, config_path or os.environ.get(CONFIG_ENV))
        self._versions: tuple[float, dict[str, str | None]] = (float("-inf"), {})
        operators = parts.operators
        self._other = Starlette(
            routes=[Route("/v1/models", self._models, methods=["GET"]),
                    Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                    Route("/health", self._health, methods=["GET"]),
                    Route("/version", self._version, methods=["GET"]),
                    Route("/openapi.json", self._openapi, methods=["GET"]),
                    Route("/admin/keys", operators.admin.guard(self._keys), methods=["GET"]),
                    *operators.ops.routes(), *operators.admin.routes(),
                    *operators.canary.routes(),
                    *(parts.batch.api.routes() if parts.batch is not None else [])],
            lifespan=Lifespan(parts, config),
            exception_handlers={404: _http_error, 405: _http_error},
        )
        guarded: ASGIApp = Http10Framing(ApiKeyAuth(self._dispatch, parts.keyring,
                                                    operators.refusals, paths=PROXIED))
        if config.gateway.cors_origins:
            # Outside the key check: a browser's preflight carries no key. A request without
            # an Origin header passes through untouched (and keeps the direct stream path).
            guarded = CORSMiddleware(
                guarded, allow_origins=list(config.gateway.cors_origins), allow_methods=["*"],
                allow_headers=["*"], max_age=600,
                expose_headers=["x-request-id", "x-gateway-backend", "x-gateway-group",
                                "x-gateway-cached-tokens"])
        self._guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            allowed = ("POST" if path in PROXIED else
                       stored[1] if path.startswith(STORED) and (stored := stored_route(path))
                       else None)
            if allowed == scope["method"]:
                await self.parts.proxy(scope, receive, send)
                return
            if allowed is not None:
                body = error_body(f"use {allowed}", "invalid_request_error",
                                  "method_not_allowed")
                await send_json(send, 405, body, request_id(scope),
                                [(b"allow", allowed.encode())])
                return
        await self._other(scope, receive, send)

    async def _models(self, request: Request) -> Response:
        data = list(self.parts.pool.cards().values())
        return JSONResponse({"object": "list", "data": data})

    async def _model(self, request: Request) -> Response:
        model = request.path_params["model"]
        card = self.parts.pool.cards().get(model)
        if card is not None:
            return JSONResponse(card)
        body = error_body(f"The model `{model[:200]}` does not exist.", "invalid_request_error",
                          "model_not_found", "model")
        return Response(body, 404, media_type="application/json")

    async def _health(self, request: Request) -> Response:
        """vLLM's own probe (GuideLLM and other tools call it): 200 with an empty body while
        some backend can serve, 503 otherwise (``/readyz`` says which)."""
        return Response(status_code=200 if self.parts.pool.ready else 503)

    async def _version(self, request: Request) -> Response:
        """The gateway's version and, by backend name, the vLLM version each one reports
        (asked all at once, within the probe timeout, at most every few seconds however often
        clients ask; null when it does not answer)."""
        at, versions = self._versions
        if time.monotonic() - at > VERSIONS_TTL:
            backends = self.parts.pool.backends
            found = await asyncio.gather(*(self.parts.probe.version(b) for b in backends))
            versions = {b.name: v for b, v in zip(backends, found, strict=True)}
            self._versions = (time.monotonic(), versions)
        return JSONResponse({"version": __version__, "backends": versions})

    async def _keys(self, request: Request) -> Response:
        """Each key's settings (never the key itself) and what it used over the window."""
        return JSONResponse(await self.parts.ledger.totals())

    async def _openapi(self, request: Request) -> Response:
        return Response(_openapi(), media_type="application/json")


@functools.cache
def _openapi() -> bytes:
    """The gateway's OpenAPI document (``gateway/openapi.yaml``), read once, as JSON."""
    document = yaml.safe_load(resources.files("gateway").joinpath("openapi.yaml").read_text())
    document["info"]["version"] = __version__
    return orjson.dumps(document)


async def _http_error(request: Request, exc: Exception) -> Response:
    """What the gateway answers itself for an unknown path or method: the OpenAI error
    format, as every other error (Starlette's default is plain text)."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "")
    if status == 404 and detail == "Not Found":
        message, code = f"Invalid URL ({request.method} {request.url.path[:200]})", "not_found"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path[:200]}"
        code = "method_not_allowed"
    else:
        message, code = str(detail), None
    return Response(error_body(message, "invalid_request_error", code), status,
                    headers=getattr(exc, "headers", None), media_type="application/json")


def from_env() -> GatewayApp:
    """The app factory each serving process calls (config path and role from the
    environment)."""
    path = os.environ[CONFIG_ENV]
    # A serving worker reads the text its control process runs (kept in the control's
    # private dir), not the file, which may have been edited since without a reload.
    text = Path(os.environ.get(CONFIG_TEXT_ENV) or path).read_text(encoding="utf-8")
    config = load(path, text=text)
    if not logging.getLogger().handlers:  # a spawned worker: logging is not set up yet
        logs.setup(config.gateway.log_level, StreamAborted, fmt=config.gateway.log_format)
    return GatewayApp(config, build(config, path, Role.from_env()))
