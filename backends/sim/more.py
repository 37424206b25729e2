"""vLLM 0.32's other generation and pooling routes, simulated: the Responses API (with its
per-instance store), Anthropic messages, audio transcription and translation (multipart),
rerank, score and pooling.

Shapes follow vLLM's protocol modules (``entrypoints/openai/responses/protocol.py``,
``anthropic/protocol.py``, ``speech_to_text/*/protocol.py``, ``pooling/*/protocol.py``);
JSON is compact, as vLLM's JSONResponse writes it. The texts are the simulator's tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from backends.sim.bodies import token_text
from backends.sim.replies import embedding_vector, error_body

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO = (TRANSCRIPTIONS, TRANSLATIONS)
RERANK = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE = ("/score", "/v1/score")
POOLING = "/pooling"


def _text(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


def _usage(prompt: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0,
            "prompt_tokens_details": None}


def response_not_found(response_id: str) -> bytes:
    return error_body(404, f"Response with id '{response_id}' not found.",
                      "invalid_request_error", "response_id")


def response(body: dict[str, Any], n_tokens: int, prompt_tokens: int,
             status: str = "completed") -> dict[str, Any]:
    """A ``ResponsesResponse`` (its main fields) for the request ``body``."""
    text = _text(n_tokens) if status == "completed" else ""
    return {
        "id": body.get("request_id") or f"resp_{uuid.uuid4().hex}",
        "created_at": int(time.time()), "instructions": body.get("instructions"),
        "metadata": body.get("metadata"), "model": body["model"], "object": "response",
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "content": [
            {"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message"}]
        if status == "completed" else [],
        "parallel_tool_calls": True, "temperature": body.get("temperature", 1.0),
        "tool_choice": "auto", "tools": [], "top_p": body.get("top_p", 1.0),
        "background": bool(body.get("background")), "max_output_tokens": n_tokens,
        "previous_response_id": body.get("previous_response_id"), "status": status,
        "text": None, "truncation": "disabled", "user": body.get("user"),
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": n_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + n_tokens} if status == "completed" else None,
    }


def response_events(done: dict[str, Any], n_tokens: int) -> list[bytes]:
    """The SSE events of a streamed response, in vLLM's order: created, in progress, the
    message item and its text part opened, one delta per token, each closed, completed."""
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    message = done["output"][0]
    part = message["content"][0]
    at = {"item_id": message["id"], "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        ("response.output_item.added", {"item": {**message, "content": [],
                                                  "status": "in_progress"},
                                        "output_index": 0}),
        ("response.content_part.added", {**at, "part": {**part, "text": ""}})]
    events += [("response.output_text.delta", {**at, "delta": token_text(i), "logprobs": []})
               for i in range(n_tokens)]
    events += [("response.output_text.done", {**at, "text": part["text"], "logprobs": []}),
               ("response.content_part.done", {**at, "part": part}),
               ("response.output_item.done", {"item": message, "output_index": 0}),
               ("response.completed", {"response": done})]
    return [b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps(
        {**data, "sequence_number": n, "type": kind})) for n, (kind, data) in enumerate(events)]


def message_body(model: str, n_tokens: int, prompt_tokens: int) -> bytes:
    """Anthropic's ``Message``, as vLLM's ``/v1/messages`` answers it."""
    return orjson.dumps({
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": _text(n_tokens)}], "model": model,
        "stop_reason": "max_tokens", "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": n_tokens}})


def audio_body(path: str, audio_bytes: int) -> bytes:
    """A transcription (with its duration usage) or a translation: the text only."""
    reply: dict[str, Any] = {"text": _text(4)}
    if path == TRANSCRIPTIONS:
        reply["usage"] = {"type": "duration", "seconds": max(1, audio_bytes // 32000)}
    return orjson.dumps(reply)


def rerank_body(model: str, query: str, documents: list[str], top_n: int | None) -> bytes:
    scored = sorted(((i, _score(query, d)) for i, d in enumerate(documents)),
                    key=lambda pair: -pair[1])[:top_n or None]
    tokens = sum(len(query) + len(d) for d in documents)
    return orjson.dumps({
        "id": f"rerank-{uuid.uuid4().hex}", "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [{"index": i, "document": {"text": documents[i], "multi_modal": None},
                     "relevance_score": s} for i, s in scored]})


def score_body(model: str, first: str, seconds: list[str]) -> bytes:
    tokens = sum(len(first) + len(s) for s in seconds)
    return orjson.dumps({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": model, "data": [{"index": i, "object": "score", "score": _score(first, s)}
                                 for i, s in enumerate(seconds)], "usage": _usage(tokens)})


def pooling_body(model: str, inputs: list[str]) -> bytes:
    return orjson.dumps({
        "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": model, "data": [{"index": i, "object": "pooling", "data": embedding_vector(t)}
                                 for i, t in enumerate(inputs)],
        "usage": _usage(sum(len(t) for t in inputs))})


def _score(a: str, b: str) -> float:
    """Shared characters over all: deterministic, in [0, 1]."""
    left, right = set(a), set(b)
    return round(len(left & right) / max(1, len(left | right)), 6)


def texts(value: object) -> list[str]:
    if isinstance(value, list):
        return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value]
    return [value if isinstance(value, str) else orjson.dumps(value).decode()]
