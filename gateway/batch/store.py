"""Where files and batches are kept: their records in Redis (JSON, one key each, listed per
owner), the files' bytes in ``[batch] dir``, named by the gateway's own ids only. An id
from a client is checked against the ids the gateway makes before it reaches Redis or a
path, so no id or name can leave the directory; a record belongs to the key that made it,
and any other key finds nothing (404, not 403: another's ids are not confirmed)."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.state.link import RedisLink

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
RESULTS = re.compile(r"batch_[0-9a-f]{24}\.(output|errors)\.jsonl")  # a batch's results
RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
         "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
SAVE = ("if redis.call('exists', KEYS[2]) == 1 then return 0 end "
        "redis.call('set', KEYS[1], ARGV[1]) return 1")
CANCEL = ("local raw = redis.call('get', KEYS[1]) if not raw then return 0 end "
          "local status = cjson.decode(raw)['status'] "
          "if status == 'completed' or status == 'failed' or status == 'expired' "
          "or status == 'cancelled' then return 0 end "
          "redis.call('set', KEYS[2], 1) redis.call('set', KEYS[1], ARGV[1]) return 1")
PRIVATE = "_"  # a record's fields that start with it are never shown to a client


class StoreUnavailable(GatewayError):
    status = 503
    kind = "server_error"
    code = "batch_store_unavailable"
    headers = [(b"retry-after", b"2")]


def new_id(kind: str) -> str:
    return f"{kind}{secrets.token_hex(12)}"


def shown(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith(PRIVATE)}


# KEYS: a key's open batches, all open batches, the record, the key's batches by time;
# ARGV: the batch's id, the limit, the record, its creation time.
CREATE = """
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""


class Store:
    def __init__(self, link: RedisLink, directory: str) -> None:
        self._link = link
        self._p = link.prefix + "batch:"
        self.dir = Path(directory)

    def path(self, name: str) -> Path:
        """A file of the directory, by a name the gateway made (never a client's)."""
        if not (FILE_ID.fullmatch(name) or RESULTS.fullmatch(name)):
            raise ValueError("not a name the gateway makes")
        return self.dir / name

    async def _run(self, *commands: tuple[Any, ...]) -> list[Any]:
        answered, results = await self._link.execute(*commands, patient=True)
        if not answered or any(isinstance(r, Exception) for r in results):
            raise StoreUnavailable("The batch store cannot be reached; try again shortly.")
        return results

    # Records, by kind: "f" files, "b" batches.
    async def put(self, kind: str, record: dict[str, Any], new: bool = False) -> None:
        rid, owner = record["id"], record["_owner"]
        commands: list[tuple[Any, ...]] = [("SET", f"{self._p}{kind}:{rid}", orjson.dumps(record))]
        if new:
            commands.append(("ZADD", f"{self._p}{kind}o:{owner}", record["created_at"], rid))
        await self._run(*commands)

    async def get(self, kind: str, rid: str, owner: str | None) -> dict[str, Any] | None:
        """The record, when ``rid`` is one of the gateway's and ``owner`` made it (None:
        any owner, for the runner)."""
        pattern = FILE_ID if kind == "f" else BATCH_ID
        if not pattern.fullmatch(rid):
            return None
        (raw,) = await self._run(("GET", f"{self._p}{kind}:{rid}"))
        if raw is None:
            return None
        record: dict[str, Any] = orjson.loads(raw)
        return record if owner is None or record.get("_owner") == owner else None

    async def listed(self, kind: str, owner: str, limit: int, after: str | None,
                     keep: Callable[[dict[str, Any]], bool] | None = None
                     ) -> tuple[list[dict[str, Any]], bool]:
        """The owner's records (those ``keep`` keeps), newest first, after the id
        ``after``; and whether more follow (a full page when they do)."""
        (ids,) = await self._run(("ZREVRANGE", f"{self._p}{kind}o:{owner}", 0, -1))
        names = [i.decode() if isinstance(i, bytes) else i for i in ids]
        if after is not None and after in names:
            names = names[names.index(after) + 1:]
        records: list[dict[str, Any]] = []
        at = 0
        while at < len(names) and len(records) < limit:
            chunk = names[at:at + max(limit - len(records), 100 if keep else 0)]
            found = await self._run(*(("GET", f"{self._p}{kind}:{n}") for n in chunk))
            for raw in found:
                at += 1
                record = orjson.loads(raw) if raw is not None else None
                if record is not None and (keep is None or keep(record)):
                    records.append(record)
                    if len(records) == limit:
                        break
        return records, at < len(names)

    async def remove(self, kind: str, record: dict[str, Any]) -> bool:
        """False when another call removed it first."""
        removed, _ = await self._run(("DEL", f"{self._p}{kind}:{record['id']}"),
                                     ("ZREM", f"{self._p}{kind}o:{record['_owner']}",
                                      record["id"]))
        return bool(removed)

    async def count(self, kind: str, owner: str) -> int:
        (n,) = await self._run(("ZCARD", f"{self._p}{kind}o:{owner}"))
        return int(n)

    async def stored_bytes(self, owner: str, change: int = 0) -> int:
        (n,) = await self._run(("INCRBY", f"{self._p}bytes:{owner}", change))
        return int(n)

    # The batches still to run (all, and per owner), for the runner and the limits.
    async def opened(self, batch_id: str, owner: str | None, is_open: bool) -> None:
        verb = "SADD" if is_open else "SREM"
        commands: list[tuple[Any, ...]] = [(verb, f"{self._p}open", batch_id)]
        if owner is not None:
            commands.append((verb, f"{self._p}open:{owner}", batch_id))
        await self._run(*commands)

    async def create(self, record: dict[str, Any], limit: int) -> bool:
        """A new batch's record written and counted among its owner's open batches, if
        that keeps them within ``limit`` (False: nothing written). One script: creates at
        once never pass the limit, and a count never outlives a record not written."""
        rid, owner = record["id"], record["_owner"]
        (ok,) = await self._run(("EVAL", CREATE, 4, f"{self._p}open:{owner}", f"{self._p}open",
                                 f"{self._p}b:{rid}", f"{self._p}bo:{owner}", rid, limit,
                                 orjson.dumps(record), record["created_at"]))
        return bool(ok)

    async def open_batches(self, owner: str | None = None) -> list[str]:
        key = f"{self._p}open" + (f":{owner}" if owner is not None else "")
        (ids,) = await self._run(("SMEMBERS", key))
        return sorted(i.decode() if isinstance(i, bytes) else i for i in ids)

    async def open_records(self) -> list[dict[str, Any]]:
        """The records of the batches not yet ended, oldest first."""
        ids = await self.open_batches()
        found = await self._run(*(("GET", f"{self._p}b:{i}") for i in ids)) if ids else []
        records = [orjson.loads(raw) for raw in found if raw is not None]
        return sorted(records, key=lambda r: r["created_at"])

    async def cancel(self, record: dict[str, Any]) -> bool:
        """Mark the batch cancelled for the runner (which may be writing its record), unless
        it ended meanwhile (False)."""
        rid = record["id"]
        (done,) = await self._run(("EVAL", CANCEL, 2, f"{self._p}b:{rid}",
                                   f"{self._p}cancel:{rid}", orjson.dumps(record)))
        return bool(done == 1)

    async def cancelled(self, batch_id: str) -> bool:
        (n,) = await self._run(("EXISTS", f"{self._p}cancel:{batch_id}"))
        return bool(n)

    async def save_running(self, record: dict[str, Any]) -> bool:
        """The runner's write of a running batch's record: not made (False) once the
        batch was cancelled, so a cancel is never overwritten."""
        rid = record["id"]
        (saved,) = await self._run(("EVAL", SAVE, 2, f"{self._p}b:{rid}",
                                    f"{self._p}cancel:{rid}", orjson.dumps(record)))
        return bool(saved == 1)

    async def lead(self, me: str, ttl: float) -> bool:
        """Take or keep the runner's lease (``ttl`` seconds): True while this one holds it."""
        key = f"{self._p}runner"
        ms = int(ttl * 1000)
        took, kept = await self._run(("SET", key, me, "NX", "PX", ms),
                                     ("EVAL", RENEW, 1, key, me, ms))
        return bool(took) or kept == 1

    async def unlink(self, name: str) -> None:
        await asyncio.to_thread(_unlink, self.path(name))


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def now() -> int:
    return int(time.time())
