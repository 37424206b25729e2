"""Completion bodies in vLLM 0.32's shape, built without per-token JSON encoding.

Key sets and order follow what vLLM's OpenAI server writes (recorded in
tests/fixtures/vllm_0.32_replies.json): the chat stream's first chunk carries the role,
the last token's chunk carries ``finish_reason`` and ``stop_reason``, and the
``system_fingerprint`` rides on the last chunk (the usage chunk when there is one).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import orjson

from backends.sim.replies import fingerprint


def token_text(i: int) -> str:
    return f" tok{i}"


_LAST_TOKEN = re.compile(r" tok(\d+)$")


def first_token(body: dict[str, Any]) -> int:
    """Where generation starts: after the last token of a partial answer it is asked to
    continue (a chat's final assistant message with ``continue_final_message``, or the end of
    a completion's prompt), as vLLM continues the text it is given; else at 0."""
    text: object = body.get("prompt", "")
    if "messages" in body:
        messages = body.get("messages") or [{}]
        text = messages[-1].get("content", "") if body.get("continue_final_message") else ""
    found = _LAST_TOKEN.search(text) if isinstance(text, str) else None
    return int(found.group(1)) + 1 if found else 0


def prompt_bytes(path: str, body: dict[str, Any]) -> bytes:
    """The text the model would see, byte-tokenised (one token per byte)."""
    if "messages" in body:
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

    def __init__(self, chat: bool, model: str, prompt_tokens: int, n_tokens: int,
                 first: int = 0, cached: tuple[int, int] | None = None) -> None:
        self.first = first  # the first token's number (a continuation starts later)
        # With --token-details (vLLM's --enable-prompt-tokens-details): the prompt tokens
        # found in the prefix cache, and those this prompt added to it.
        self.cached = cached
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.n_tokens = max(n_tokens, 1)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":"{self.id}","object":"{self.object}","created":{self.created},'
            f'"model":{orjson.dumps(model).decode()},"choices":[{{"index":0,'
        )
        if chat:
            self._pre = (head + '"delta":{"content":"').encode()
            self._post = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._pre = (head + '"text":"').encode()
            self._post = (b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                          b'"prompt_token_ids":null,"token_ids":null}]}\n\n')

    def role_chunk(self) -> bytes:
        """The chat stream's first event (completions have none)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._event([choice], prompt_token_ids=None, prompt_text=None)

    def token_chunk(self, i: int) -> bytes:
        return self._pre + token_text(self.first + i).encode() + self._post

    def last_chunk(self, usage_follows: bool) -> bytes:
        """The last token's event: the finish reason, and the fingerprint unless usage follows."""
        text = token_text(self.first + self.n_tokens - 1)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice |= {"delta": {"content": text}, "logprobs": None, "finish_reason": "length",
                       "stop_reason": None, "token_ids": None}
        else:
            choice |= {"text": text, "logprobs": None, "finish_reason": "length",
                       "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
        if usage_follows:
            return self._event([choice])
        return self._event([choice], system_fingerprint=fingerprint(self.model))

    def usage_chunk(self) -> bytes:
        return self._event([], usage=self.usage(), system_fingerprint=fingerprint(self.model))

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.n_tokens,
            "completion_tokens": self.n_tokens,
        }
        if self.cached is not None:
            usage["prompt_tokens_details"] = self.details()
        return usage

    def details(self) -> dict[str, Any] | None:
        """``prompt_tokens_details`` as vLLM 0.32 fills it (chat_completion/serving.py
        ``_make_prompt_tokens_details``; completions set ``cached_tokens`` alone)."""
        if self.cached is None:
            return None
        return {"cached_tokens": self.cached[0],
                "created_cache_tokens": self.cached[1] if self.chat else None,
                "multimodal_tokens": None}

    def whole(self) -> bytes:
        text = "".join(token_text(self.first + i) for i in range(self.n_tokens))
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None}
            choice |= {"logprobs": None, "finish_reason": "length", "stop_reason": None,
                       "token_ids": None, "routed_experts": None}
        else:
            choice |= {"text": text, "logprobs": None, "finish_reason": "length",
                       "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                       "prompt_token_ids": None, "routed_experts": None}
        usage = {**self.usage(), "prompt_tokens_details": self.details(),
                 "completion_tokens_details": None}
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice],
            "service_tier": None, "system_fingerprint": fingerprint(self.model), "usage": usage,
        }
        if self.chat:
            body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return orjson.dumps(body)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload: dict[str, Any] = {"id": self.id, "object": self.object,
                                   "created": self.created, "model": self.model,
                                   "choices": choices, **extra}
        return b"data: " + orjson.dumps(payload) + b"\n\n"
