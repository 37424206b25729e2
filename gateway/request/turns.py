"""A conversation's prompt tokens, remembered from one turn to the next, so that a
multi-turn chat does not pay to tokenize its whole history at every turn.

Turn k+1 of a conversation repeats turn k's messages and adds the reply and a question
(an OpenAI client resends the whole history; no session key needed). The tokens of turn
k's prompt, as vLLM rendered them, are therefore the start of turn k+1's: its history's
blocks, where vLLM cached them. So a chat request whose messages begin with a remembered
request's messages (all but its last one, two or three) is routed by those tokens with
no ``/tokenize`` at all, and remembered in turn under its own messages. Its prediction is
then partial: a lower bound of what vLLM finds (the new turn's tokens are not counted),
judged as one. Once the part of a prompt not tokenized passes a third of its characters,
it is tokenized whole again, so a conversation is tokenized a number of times that grows
with the log of its length, not with its turns.

What is kept: per serving process, the token ids of recent conversations (32-bit, newest
last), ``MAX_TOKENS`` of them at most, keyed by a digest of the model, the fields that
change the rendering and the messages; the last ``SLACK`` tokens of a prompt (the
generation prompt, whose rendering the next turn's assistant message may change) are not.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

MAX_TOKENS = 4_000_000  # token ids kept per serving process (16 MB)
UNKNOWN_SHARE = 1 / 3  # of a prompt's characters, past which it is tokenized whole again
SLACK = 8  # trailing tokens not kept: the generation prompt (Llama 3's is 4, ChatML's 3)
BACK = 3  # a remembered request has all but the last 1 .. BACK messages of the new one
# What changes how the same messages render (vLLM's /tokenize takes them as serving does).
RENDERING = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
             "chat_template", "chat_template_kwargs", "tools")


@dataclass(frozen=True, slots=True)
class Known:
    """The tokens known of a prompt's start, and the characters of the messages they
    stand for."""

    tokens: array[int]
    chars: int


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat request's messages, digested: one digest per leading run of messages (the
    last is the whole request's) and its characters so far."""

    digests: list[bytes]
    chars: list[int]


def conversation(model: str, payload: Mapping[str, Any]) -> Conversation | None:
    """The digests of ``payload``'s messages (None: not a chat request the gateway reads)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    digest = hashlib.blake2b(digest_size=16)
    digest.update(orjson.dumps([model, *(payload.get(k) for k in RENDERING)]))
    digests, chars, total = [], [], 0
    for message in messages:
        try:
            raw = orjson.dumps(message)
        except TypeError:
            return None
        content = message.get("content") if isinstance(message, dict) else None
        total += len(content) if isinstance(content, str) else len(raw)
        digest.update(raw)
        digests.append(digest.copy().digest())
        chars.append(total)
    return Conversation(digests, chars)


class Turns:
    def __init__(self, cap: int = MAX_TOKENS) -> None:
        self._held: OrderedDict[bytes, Known] = OrderedDict()
        self._tokens = 0
        self._cap = cap

    def recall(self, talk: Conversation) -> Known | None:
        """The known start of this request's prompt: a remembered earlier turn's, when
        what it does not cover is at most ``UNKNOWN_SHARE`` of the characters; it is
        then remembered under this request's messages too."""
        n, chars = len(talk.digests), talk.chars[-1]
        for j in range(n - 2, max(-1, n - 2 - BACK), -1):
            known = self._held.get(talk.digests[j])
            if known is None:
                continue
            if chars - known.chars > UNKNOWN_SHARE * chars:
                return None
            self._held.move_to_end(talk.digests[j])
            self._put(talk.digests[-1], known)
            return known
        return None

    def keep(self, talk: Conversation, tokens: Sequence[int]) -> None:
        """The whole prompt's ``tokens``, for the next turn."""
        kept = array("I", tokens[:max(0, len(tokens) - SLACK)])
        self._put(talk.digests[-1], Known(kept, talk.chars[-1]))

    def _put(self, digest: bytes, known: Known) -> None:
        old = self._held.pop(digest, None)
        if old is not None:
            self._tokens -= len(old.tokens)
        self._held[digest] = known
        self._tokens += len(known.tokens)
        while self._tokens > self._cap and self._held:
            _, gone = self._held.popitem(last=False)
            self._tokens -= len(gone.tokens)

    def __len__(self) -> int:
        return len(self._held)
