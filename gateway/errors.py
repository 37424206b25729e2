"""The gateway's exceptions and the OpenAI error body they become."""

from __future__ import annotations

import orjson

EXIT_CONFIG = 2  # the exit code of a config problem (bad file, unusable data dir)


def error_body(message: str, kind: str, code: str | int | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def sse_error_event(message: str, kind: str, code: str | int | None) -> bytes:
    """The one event that ends a failed stream; no ``[DONE]`` follows it."""
    return b"data: " + error_body(message, kind, code) + b"\n\n"


class GatewayError(Exception):
    """An error answered to the client before any byte of a reply was sent."""

    status = 500
    kind = "server_error"
    code = "internal_error"

    headers: list[tuple[bytes, bytes]] | None = None  # sent with it (Retry-After...)

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, where there is one

    def body(self) -> bytes:
        return error_body(self.message, self.kind, self.code, self.param)


class BadRequest(GatewayError):
    status = 400
    kind = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(GatewayError):
    status = 401
    kind = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    kind = "invalid_request_error"
    code = "model_not_found"


class ResponseNotFound(GatewayError):
    """A stored response (the Responses API) the gateway has no record of."""

    status = 404
    kind = "invalid_request_error"
    code = "response_not_found"


class ResponseUnavailable(GatewayError):
    """A stored response whose backend can't be reached now: no other one holds it."""

    status = 503
    kind = "service_unavailable"
    code = "response_unavailable"


class RateLimited(GatewayError):
    """A key's limit: answered 429 with ``Retry-After``."""

    status = 429
    kind = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int, kind: str = "requests") -> None:
        super().__init__(message)
        self.kind = kind
        self.headers = [(b"retry-after", str(max(1, retry_after)).encode())]


class Forbidden(GatewayError):
    status = 403
    kind = "permission_error"
    code = "model_not_allowed"


class RequestTimeout(GatewayError):
    status = 408
    kind = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    kind = "invalid_request_error"
    code = "payload_too_large"


class NoBackend(GatewayError):
    status = 503
    kind = "service_unavailable"
    code = "no_backend_available"


class Overloaded(GatewayError):
    """Too many request bytes held at once by this process (``max_buffered_bytes``)."""

    status = 503
    code = "overloaded"


class Shed(GatewayError):
    """Held in the gateway's queue and let go: it was full, or the wait ran out."""

    status = 503
    kind = "service_unavailable"

    def __init__(self, message: str, code: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.code = code
        self.headers = [(b"retry-after", str(retry_after).encode())]


class UpstreamUnavailable(GatewayError):
    status = 502
    kind = "bad_gateway"
    code = "upstream_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    kind = "timeout"
    code = "upstream_timeout"


class AdminError(GatewayError):
    """An operator's request to /admin refused; nothing was changed."""

    status = 400
    kind = "admin_error"
    code = "invalid_request"


class AdminUnauthorized(AdminError):
    status = 401
    code = "invalid_admin_key"


class BackendNotFound(AdminError):
    status = 404
    code = "backend_not_found"


class NotSpawned(AdminError):
    code = "not_spawned"


class UnknownAction(AdminError):
    status = 404
    code = "not_found"


class NoCanary(AdminError):
    status = 409
    code = "no_canary"


class NoConfigPath(AdminError):
    code = "no_path"


class ReloadRefused(AdminError):
    """The config file could not be used; the running config stays."""

    kind = "invalid_config"
    code = "invalid_config"

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems  # ``dotted.key: message`` lines, as at start-up

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.kind, "param": None,
                                       "code": self.code, "problems": self.problems}})


class StreamAborted(Exception):
    """A non-streaming reply broke after its headers went out; the connection must drop."""
