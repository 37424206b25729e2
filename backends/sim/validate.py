"""vLLM's request checks, in vLLM's order: media type, JSON, required fields, model.

Each failure carries the status and body vLLM 0.32 answers with (see
tests/fixtures/vllm_0.32_replies.json): FastAPI validation errors are type "Bad Request",
vLLM's own checks "BadRequestError", an unknown model a 404 "NotFoundError".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from backends.sim import more
from backends.sim.replies import error_body, unknown_model

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
ENCODING_FORMATS = ("float", "base64")
LIMITED = frozenset({CHAT, COMPLETIONS, more.RESPONSES, more.MESSAGES, *more.RERANK})
REQUIRED: dict[str, tuple[str, ...]] = {
    more.RESPONSES: ("input",), more.MESSAGES: ("messages", "max_tokens"),
    more.POOLING: ("input",), **dict.fromkeys(more.RERANK, ("query", "documents")),
}


@dataclass(frozen=True, slots=True)
class Rejected:
    status: int
    body: bytes


def _validation(kind: str, loc: str, msg: str, value: str | None = None,
                param: str | None = "") -> Rejected:
    entry = f"'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}'"
    if value is not None:
        entry += f", 'input': '{value}'"
    message = f"1 validation error:\n  {{{entry}}}"
    return Rejected(400, error_body(400, message, "Bad Request", loc if param == "" else param))


def _missing(field: str, body: dict[str, Any]) -> Rejected:
    return _validation("missing", f"body.{field}", "Field required", f"<dict of {len(body)} items>")


def parse(path: str, content_type: str, raw: bytes) -> dict[str, Any] | Rejected:
    """The request body as vLLM would accept it, or what vLLM answers instead."""
    if path in more.AUDIO:
        return _form(content_type, raw)
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        message = ("1 validation error:\n"
                   "  Unsupported Media Type: Only 'application/json' is allowed")
        return Rejected(400, error_body(400, message, "Bad Request"))
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _validation("json_invalid", f"body.{exc.pos}", "JSON decode error")
    if not isinstance(body, dict):
        return _validation("model_attributes_type", "body",
                           "Input should be a valid dictionary or object to extract fields from")
    return _required(path, body) or body


def _limits(body: dict[str, Any]) -> Rejected | None:
    """Token limits are integers (or null), as vLLM's request models say."""
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "top_n"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return _validation("int_parsing", f"body.{field}",
                               "Input should be a valid integer, unable to parse string as an "
                               "integer" if isinstance(value, str) else
                               "Input should be a valid integer")
    return None


def _required(path: str, body: dict[str, Any]) -> Rejected | None:
    if path in LIMITED and (bad := _limits(body)) is not None:
        return bad
    if path == CHAT and "messages" not in body:
        return _missing("messages", body)
    if path == COMPLETIONS and not body.get("prompt"):
        message = ("Either prompt or prompt_embeds must be provided and non-empty. "
                   "(parameter=prompt)")
        return Rejected(400, error_body(400, message, "BadRequestError", "prompt"))
    if path == EMBEDDINGS:
        if "input" not in body:
            return _missing("input", body)
        if body.get("encoding_format", "float") not in ENCODING_FORMATS:
            return _validation("literal_error", "body.encoding_format",
                               "Input should be 'float' or 'base64' (the simulator's formats)")
    for field in REQUIRED.get(path, ()):
        if field not in body:
            return _missing(field, body)
    if path in more.SCORE and not any(f in body for f in ("text_1", "queries", "data_1")):
        return _missing("queries", body)
    if path == TOKENIZE and "prompt" not in body and "messages" not in body:
        return _missing("prompt", body)
    if path == TOKENIZE and "prompt" in body and not isinstance(body["prompt"], str):
        return _validation("string_type", "body.prompt", "Input should be a valid string")
    if path == DETOKENIZE:
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            return _missing("tokens", body)
        wrong = next((i for i, t in enumerate(tokens)
                      if not isinstance(t, int) or isinstance(t, bool)), None)
        if wrong is not None:
            return _validation("int_type", f"body.tokens.{wrong}",
                               "Input should be a valid integer")
    return None


def check_model(path: str, body: dict[str, Any], served: tuple[str, ...]) -> Rejected | None:
    """A missing model means the first served one (vLLM's default); another name is a 404."""
    model = body.get("model")
    if not model or model in served:
        return None
    return Rejected(404, unknown_model(model, served, pooling=path == EMBEDDINGS))


def _form(content_type: str, raw: bytes) -> dict[str, Any] | Rejected:
    """A multipart upload as vLLM's form model reads it: the text fields, and ``file`` as
    the number of bytes uploaded (the simulator does not listen)."""
    fields: dict[str, Any] = {}
    current: dict[str, Any] = {}

    def header_value(data: bytes, start: int, end: int) -> None:
        _, params = parse_options_header(data[start:end])
        if b"name" in params:
            current.update(name=params[b"name"].decode(), file=b"filename" in params, data=[])

    def part_data(data: bytes, start: int, end: int) -> None:
        current["data"].append(data[start:end])

    def part_end() -> None:
        value = b"".join(current.pop("data", []))
        if "name" in current:
            fields[current["name"]] = len(value) if current["file"] else value.decode()
        current.clear()

    _, params = parse_options_header(content_type.encode("latin-1"))
    try:
        parser = MultipartParser(params.get(b"boundary", b""), {
            "on_header_value": header_value, "on_part_data": part_data,
            "on_part_end": part_end})
        parser.write(raw)
        parser.finalize()
    except (MultipartParseError, ValueError):
        return _validation("value_error", "body", "There was an error parsing the body")
    if "file" not in fields:
        return _missing("file", fields)
    return fields
