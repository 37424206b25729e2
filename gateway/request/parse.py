"""A client's request, parsed once into a ``Request``: its model, stream flag, session key,
client address, and for the Responses API the stored response it makes or names."""

from __future__ import annotations

from starlette.types import Scope

from gateway.config import Config
from gateway.config.values import SessionFrom
from gateway.errors import BadRequest
from gateway.http.asgi import json_object
from gateway.http.form import form_fields, is_form
from gateway.http.forwarded import Forwarding
from gateway.routing.pool import BackendPool
from gateway.routing.responses import RESPONSES, ResponsePins, stored_route
from gateway.tenants.usage import with_usage
from gateway.types import Request


class RequestParser:
    def __init__(self, config: Config, responses: ResponsePins, pool: BackendPool,
                 inject_usage: bool = False) -> None:
        self._responses = responses
        self._pool = pool
        self._inject = inject_usage
        self._max_session_key = config.routing.session_key_max_len
        self._session_sources = config.routing.session_keys
        self._forwarding = Forwarding(config.gateway.trusted_proxies)

    def __call__(self, scope: Scope, body: bytes, rid: str, begun: float) -> Request:
        path, method, creates, follows, strip = scope["path"], "POST", None, None, False
        model: object
        stored = stored_route(path)
        if stored is not None:  # a stored response's retrieval or cancel: no body, no model
            (follows, method), payload, model = stored, {}, ""
            if query := scope.get("query_string"):
                path += "?" + query.decode("latin-1")
        else:
            payload = _payload(scope["headers"], body)
            model = payload.get("model")
            if model is None:
                model = self._default_model()
            if not isinstance(model, str) or not model:
                raise BadRequest("'model' is required and must be a non-empty string")
            if path == RESPONSES:
                body, creates, follows = self._responses.name(payload, body)
            elif self._inject and (asking := with_usage(path, payload, body)) is not None:
                body, strip = asking, True
                payload["stream_options"] = {"include_usage": True}  # an alias's body too
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        peer = scope.get("client")
        client, forwarded_for = self._forwarding.client(peer[0] if peer else "", headers)
        return Request(
            request_id=rid, path=path, model=model, stream=payload.get("stream") is True,
            session_key=self._session_key(headers, payload), body=body, headers=headers,
            payload=payload, started=begun, client=client, forwarded_for=forwarded_for,
            method=method, creates=creates, follows=follows, strip_usage=strip,
        )

    def _default_model(self) -> str:
        """No ``model``: the one model served, as vLLM takes its own; with several, which
        one is meant can't be told."""
        served = self._pool.models()
        if len(served) == 1:
            return served[0]
        raise BadRequest("'model' is required: this gateway serves "
                         f"{len(served)} models (GET /v1/models lists them)", "model")

    def _session_key(
        self, headers: list[tuple[bytes, bytes]], payload: dict[str, object]
    ) -> str | None:
        for source in self._session_sources:
            value: object
            if source.kind is SessionFrom.HEADER:
                value = next((v.decode("latin-1") for k, v in headers if k == source.header),
                             None)
            else:
                value = payload.get(source.name)
            if isinstance(value, str) and value:
                if len(value) > self._max_session_key:
                    raise BadRequest(
                        f"session key is longer than {self._max_session_key} characters")
                return value
        return None


def _payload(headers: list[tuple[bytes, bytes]], body: bytes) -> dict[str, object]:
    """The JSON body; for a multipart upload (audio), its text fields (``stream`` as a
    boolean, as vLLM reads it)."""
    content_type = next((v for k, v in headers if k == b"content-type"), b"")
    if not is_form(content_type):
        return json_object(body, BadRequest, "request body")
    fields = form_fields(body, content_type)
    if isinstance(stream := fields.get("stream"), str):
        fields["stream"] = stream.lower() in ("true", "1")
    return fields
