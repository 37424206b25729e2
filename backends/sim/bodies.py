"""Response bodies in vLLM's OpenAI shape, built without per-token JSON encoding."""

from __future__ import annotations

import time
import uuid
import zlib
from typing import Any

import orjson


def token_text(i: int) -> str:
    return f" tok{i}"


def prompt_bytes(path: str, body: dict[str, Any]) -> bytes:
    """The text the model would see, byte-tokenised (one token per byte)."""
    if path.endswith("/chat/completions"):
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content", "")
            if not isinstance(content, str):
                content = orjson.dumps(content).decode()
            parts.append(f"<|{message.get('role', 'user')}|>{content}\n")
        return "".join(parts).encode()
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = "".join(p if isinstance(p, str) else orjson.dumps(p).decode() for p in prompt)
    return str(prompt).encode()


class Completion:
    """One completion's chunks and final body; ``chat`` picks the wire shape."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, n_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.n_tokens = n_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
            f'"model":{orjson.dumps(model).decode()},"choices":[{{"index":0,'
        )
        if chat:
            self._pre = (head + '"delta":{"content":"').encode()
        else:
            self._pre = (head + '"text":"').encode()
        self._post = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        if not chat:
            self._post = b'","logprobs":null,"finish_reason":null}]}\n\n'

    def role_chunk(self) -> bytes:
        return self._event(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
        )

    def token_chunk(self, i: int) -> bytes:
        return self._pre + token_text(i).encode() + self._post

    def final_chunk(self) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._event(choice)

    def usage_chunk(self) -> bytes:
        return self._event(None, usage=self.usage())

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.n_tokens,
            "total_tokens": self.prompt_tokens + self.n_tokens,
        }

    def whole(self) -> bytes:
        text = "".join(token_text(i) for i in range(self.n_tokens))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(),
            }
        )

    def _event(self, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_body(status: int, message: str, kind: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}})


def embeddings_body(model: str, inputs: list[str]) -> bytes:
    data = []
    for i, text in enumerate(inputs):
        h = zlib.crc32(text.encode())
        vector = [((h >> (k * 4)) & 0xF) / 15.0 for k in range(8)]
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(t.encode()) for t in inputs)
    return orjson.dumps(
        {"object": "list", "data": data, "model": model,
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )
