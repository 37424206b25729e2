"""vLLM 0.32's non-completion replies: errors, models, embeddings, tokenize, version.

Shapes follow ``vllm/entrypoints/serve/engine/protocol.py`` and the replies recorded in
tests/fixtures/vllm_0.32_replies.json. All JSON is compact (Starlette's JSONResponse).
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import orjson

VLLM_VERSION = "0.32.0"
DIMENSIONS = 8  # length of a simulated embedding vector


def fingerprint(model: str) -> str:
    """``system_fingerprint``: vLLM's version and a short hash, as vLLM writes it."""
    return f"vllm-{VLLM_VERSION}-{zlib.crc32(model.encode()):08x}"


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """vLLM's ErrorResponse: ``{"error":{"message","type","param","code"}}``."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}})


def streaming_error(status: int, message: str, kind: str) -> bytes:
    """An error inside a 200 stream: vLLM writes it with ``json.dumps``, spaced, not compact."""
    error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


def detail_body(detail: str) -> bytes:
    """Starlette's own 404/405 body, which vLLM leaves as it is for unknown routes."""
    return orjson.dumps({"detail": detail})


def unknown_model(model: object, served: tuple[str, ...], pooling: bool = False) -> bytes:
    """vLLM's 404; its pooling routes (embeddings) word it shorter and name no param."""
    if pooling:
        return error_body(404, f"The model `{model}` does not exist.", "NotFoundError")
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
    return error_body(404, message, "NotFoundError", "model")


def models_body(models: tuple[str, ...], max_model_len: int,
                adapters: Callable[[int], list[dict[str, Any]]] | None = None) -> bytes:
    """vLLM's ``/v1/models``: the base models, then the LoRA adapters loaded (``adapters``
    gives their cards, each without its permission)."""
    now = int(time.time())
    data = [
        {"id": m, "object": "model", "created": now, "owned_by": "vllm", "root": m,
         "parent": None, "max_model_len": max_model_len, "permission": [_permission(now)]}
        for m in models
    ] + [{**card, "permission": [_permission(now)]}
         for card in (adapters(now) if adapters is not None else [])]
    return orjson.dumps({"object": "list", "data": data})


def _permission(now: int) -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
        "created": now, "allow_create_engine": False, "allow_sampling": True,
        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
    }


def embedding_vector(text: str) -> list[float]:
    """A deterministic vector per text; values exact in float32, so base64 round-trips."""
    h = zlib.crc32(text.encode())
    return [((h >> (k * 4)) & 0xF) / 16.0 for k in range(DIMENSIONS)]


def encode_vector(vector: list[float], encoding_format: str, endianness: str) -> Any:
    """``float``: the list; ``base64``: float32 bytes, base64 (vLLM's default for base64)."""
    if encoding_format == "float":
        return vector
    order = ">" if endianness == "big" else "<"  # "native" is little-endian on x86 and arm
    return base64.b64encode(struct.pack(f"{order}{len(vector)}f", *vector)).decode()


def embeddings_body(model: str, inputs: list[str], encoding_format: str = "float",
                    endianness: str = "native") -> bytes:
    data = [
        {"index": i, "object": "embedding",
         "embedding": encode_vector(embedding_vector(text), encoding_format, endianness)}
        for i, text in enumerate(inputs)
    ]
    tokens = sum(len(t.encode()) for t in inputs)
    return orjson.dumps(
        {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
         "model": model, "data": data,
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                   "prompt_tokens_details": None, "completion_tokens_details": None}}
    )


def tokenize_body(prompt: bytes, max_model_len: int, token_strs: bool) -> bytes:
    """The simulator's tokenizer is one token per byte (as prompt_tokens counts)."""
    tokens = list(prompt)
    strs = [bytes([t]).decode("latin-1") for t in tokens] if token_strs else None
    return orjson.dumps({"count": len(tokens), "max_model_len": max_model_len,
                         "tokens": tokens, "token_strs": strs})


def detokenize_body(tokens: list[int]) -> bytes:
    text = bytes(t & 0xFF for t in tokens).decode("utf-8", errors="replace")
    return orjson.dumps({"prompt": text})


def version_body() -> bytes:
    return orjson.dumps({"version": VLLM_VERSION})


def inputs(value: object) -> list[str]:
    """One text per embedding: a string, a list of strings, or token ids (one list a prompt)."""
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return [orjson.dumps(value).decode()]
        return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value]
    return [str(value)]


def too_long(limit: int, tokens: int) -> bytes:
    message = (f"This model's maximum context length is {limit} tokens. However, your prompt "
               f"contains at least {limit + 1} input tokens, which exceeds this limit even "
               f"without any output tokens. Please reduce the length of the input prompt. "
               f"(parameter=input_tokens, value={tokens})")
    return error_body(400, message, "BadRequestError", "input_tokens")
