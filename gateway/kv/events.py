"""vLLM's KV-cache events (0.32, ``vllm/distributed/kv_events.py``) decoded into plain,
checked values: each ZMQ message's payload is a msgpack batch ``[ts, events, dp_rank]``
(``array_like``; a map ``{ts, events, data_parallel_rank}`` is read too), each event a map
tagged by its ``"type"`` (or an array ``[type, *fields]`` in declared order).

A stream is never trusted: anything that is not such a batch (garbage, a truncated
message, a wrong type, token ids that do not fill the blocks, more than ``MAX_EVENTS``
events or ``MAX_BLOCKS`` blocks) raises ``BadEvents``, which the caller counts and drops;
nothing of a bad batch is applied.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_EVENTS = 100_000  # per batch (one engine step's)
MAX_BLOCKS = 65_536  # per BlockStored event: 1M tokens at vLLM's smallest block size
MAX_BLOCK_SIZE = 4096
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")

BlockHash = int | bytes


class BadEvents(ValueError):
    """A payload that is not a batch of vLLM's KV events (the words say what is wrong)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks newly cached: ``hashes[i]`` holds ``tokens[i*size:(i+1)*size]``."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None  # the block before the first; None from the prompt's start
    tokens: array[int]  # 32-bit ids, as the index hashes them
    size: int
    lora: str | None
    extra: tuple[object, ...] | None  # one entry per block (LoRA, media, cache_salt)
    medium: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[BlockHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of the instance dropped (a prefix-cache reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    rank: int


_decoder = msgspec.msgpack.Decoder()


def decode(payload: bytes) -> Batch:
    """One ZMQ message's payload, checked whole; ``BadEvents`` if any of it is wrong."""
    try:
        return _decode(payload)
    except BadEvents:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise BadEvents(f"not vLLM's KV events: {type(exc).__name__}") from None


def _decode(payload: bytes) -> Batch:
    raw = _decoder.decode(payload)
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank", 0)]
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise BadEvents("a batch is [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 and raw[2] is not None else 0
    if not isinstance(ts, int | float) or not isinstance(events, list) or type(rank) is not int:
        raise BadEvents("a batch is [ts, events, data_parallel_rank]")
    if len(events) > MAX_EVENTS:
        raise BadEvents(f"{len(events)} events in one batch (at most {MAX_EVENTS})")
    return Batch(float(ts), tuple(_event(e) for e in events), rank)


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """An event's type and its fields by name, from either form."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise BadEvents("an event is a map or an array")
    if not isinstance(kind, str):
        raise BadEvents("an event has no type")
    return kind, fields


def _event(raw: Any) -> Event:
    kind, _ = _fields(raw, ())
    if kind == "BlockStored":
        return _stored(_fields(raw, _STORED_FIELDS)[1])
    if kind == "BlockRemoved":
        fields = _fields(raw, _REMOVED_FIELDS)[1]
        return Removed(_hashes(fields.get("block_hashes")), _text(fields.get("medium")))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise BadEvents(f"unknown event type {kind[:64]!r}")


def _stored(fields: dict[str, Any]) -> Stored:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise BadEvents("parent_block_hash is not a block hash")
    size = fields.get("block_size")
    if type(size) is not int or not 0 < size <= MAX_BLOCK_SIZE:
        raise BadEvents("block_size is not a block size")
    raw = fields.get("token_ids")
    if not isinstance(raw, list) or len(raw) != len(hashes) * size:
        raise BadEvents("token_ids do not fill the blocks")
    try:  # C's check of every id at once: an int from 0 to 2**32 - 1
        tokens = array("I", raw)
    except (TypeError, OverflowError):
        raise BadEvents("token_ids are not token ids") from None
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise BadEvents("extra_keys is not one entry per block")
    return Stored(hashes, parent, tokens, size, _text(fields.get("lora_name")),
                  tuple(_frozen(e) for e in extra) if extra is not None else None,
                  _text(fields.get("medium")))


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_BLOCKS:
        raise BadEvents(f"block_hashes is not a list of 1 to {MAX_BLOCKS} hashes")
    if not all(_is_hash(h) for h in raw):
        raise BadEvents("block_hashes holds something that is not a block hash")
    return tuple(raw)


def _is_hash(value: Any) -> bool:
    if type(value) is int:
        return 0 <= value < 1 << 64
    return isinstance(value, bytes) and 0 < len(value) <= 64


def _text(value: Any) -> str | None:
    return value[:256] if isinstance(value, str) else None


def _frozen(value: Any) -> object:
    """An extra key as a hashable value (msgpack arrays come back as lists)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value
