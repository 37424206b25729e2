"""An in-memory stand-in for ``gateway.state.link.RedisLink``, to drive the gateway's shared
state (limits, ledger, pins, arms, response pins, reply cache, breaker and canary sync)
without a socket or a process.

It answers the commands the gateway sends, as the real link returns them (strings, ints,
None, HGETALL as a flat list, an error as an exception instance in the results), keeps TTLs
on an injectable clock (``Clock``: advanced by hand), runs the tenant limits' Lua script
(recognized by identity with ``gateway.tenants.limits.SCRIPT``) in Python, and gives
``call(op)`` a client with the few redis-py methods the background loops use. ``down``
makes it answer as the real link does while Redis is away. Anything else raises
``NotImplementedError``: a test never passes against a command the fake does not know.
``tests/gateway/state/test_link_contract.py`` holds it to the real link on a real server.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from gateway.routing import pins
from gateway.state.link import text
from gateway.tenants import limits

Command = tuple[Any, ...]
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "ERR value is not an integer or out of range"


class ReplyError(ResponseError):
    """A command's error: returned in its place by ``execute`` (as hiredis returns a reply
    error), raised by the client (as redis-py raises one)."""


class Clock:
    """Seconds, moved on by ``advance`` only."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _text(value: Any) -> str:
    """A command argument as Redis stores it (the link packs numbers with ``repr``)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    return str(value)


def _int(value: Any) -> int:
    try:
        return int(_text(value))
    except ValueError:
        raise ReplyError(NOT_INTEGER) from None


def _score(bound: Any) -> tuple[float, bool]:
    """A ZRANGEBYSCORE bound: (value, exclusive)."""
    raw = _text(bound)
    exclusive = raw.startswith("(")
    raw = raw[1:] if exclusive else raw
    value = {"-inf": -math.inf, "+inf": math.inf, "inf": math.inf}.get(raw)
    return (float(raw) if value is None else value), exclusive


class Store:
    """The keyspace: strings, hashes and sorted sets, each key with an optional deadline."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._data: dict[str, tuple[str, Any]] = {}  # key -> (type, value)
        self._expires: dict[str, float] = {}  # key -> deadline, in ms on the clock

    def _ms(self) -> float:
        return self._clock() * 1000

    def _live(self, key: str) -> tuple[str, Any] | None:
        deadline = self._expires.get(key)
        if deadline is not None and self._ms() > deadline:
            self.delete(key)
        return self._data.get(key)

    def get(self, key: str, kind: str) -> Any:
        found = self._live(key)
        if found is None:
            return None
        if found[0] != kind:
            raise ReplyError(WRONGTYPE)
        return found[1]

    def put(self, key: str, kind: str, value: Any, keep_ttl: bool = True) -> None:
        self._data[key] = (kind, value)
        if not keep_ttl:
            self._expires.pop(key, None)

    def delete(self, key: str) -> bool:
        self._expires.pop(key, None)
        return self._data.pop(key, None) is not None

    def exists(self, key: str) -> bool:
        return self._live(key) is not None

    def expire_in(self, key: str, ms: int) -> bool:
        if not self.exists(key):
            return False
        if ms <= 0:
            self.delete(key)
        else:
            self._expires[key] = self._ms() + ms
        return True

    def pttl(self, key: str) -> int:
        if not self.exists(key):
            return -2
        deadline = self._expires.get(key)
        return -1 if deadline is None else max(0, round(deadline - self._ms()))

    def keys(self) -> list[str]:
        return sorted(k for k in list(self._data) if self.exists(k))


class Commands:
    """Each command as Redis answers it (RESP2, decoded: what the link's callers get)."""

    def __init__(self, store: Store) -> None:
        self.s = store

    def run(self, args: Command) -> Any:
        name = _text(args[0]).upper()
        handler = getattr(self, f"c_{name}", None)
        if handler is None:
            raise NotImplementedError(f"MemoryLink does not know {name}")
        return handler(*args[1:])

    # strings
    def c_GET(self, key: str) -> str | None:
        return self.s.get(key, "string")  # type: ignore[no-any-return]

    def c_MGET(self, *keys: str) -> list[str | None]:
        return [self._maybe(key) for key in keys]

    def _maybe(self, key: str) -> str | None:
        found = self.s._live(key)
        return found[1] if found is not None and found[0] == "string" else None

    def c_SET(self, key: str, value: Any, *options: Any) -> str | None:
        opts = [_text(o).upper() for o in options]
        nx, xx, get = "NX" in opts, "XX" in opts, "GET" in opts
        ttl = None
        for unit, scale in (("PX", 1), ("EX", 1000)):
            if unit in opts:
                ttl = _int(options[opts.index(unit) + 1]) * scale
        old = self.s.get(key, "string") if get else self._maybe(key)
        present = self.s.exists(key)
        if (nx and present) or (xx and not present):
            return old if get else None
        self.s.put(key, "string", _text(value), keep_ttl="KEEPTTL" in opts)
        if ttl is not None:
            self.s.expire_in(key, ttl)
        return old if get else "OK"

    def c_GETEX(self, key: str, *options: Any) -> str | None:
        value = self.c_GET(key)
        opts = [_text(o).upper() for o in options]
        if value is not None and opts:
            if opts[0] == "PERSIST":
                self.s.put(key, "string", value, keep_ttl=False)
            else:
                scale = {"PX": 1, "EX": 1000}[opts[0]]
                self.s.expire_in(key, _int(options[1]) * scale)
        return value

    def c_INCR(self, key: str) -> int:
        return self.c_INCRBY(key, 1)

    def c_INCRBY(self, key: str, by: Any) -> int:
        value = _int(self.s.get(key, "string") or 0) + _int(by)
        self.s.put(key, "string", str(value))
        return value

    # keys
    def c_DEL(self, *keys: str) -> int:
        return sum(self.s.delete(key) for key in keys)

    def c_EXISTS(self, *keys: str) -> int:
        return sum(self.s.exists(key) for key in keys)

    def c_PEXPIRE(self, key: str, ms: Any) -> int:
        return int(self.s.expire_in(key, _int(ms)))

    def c_EXPIRE(self, key: str, seconds: Any) -> int:
        return int(self.s.expire_in(key, _int(seconds) * 1000))

    def c_PTTL(self, key: str) -> int:
        return self.s.pttl(key)

    # hashes
    def _hash(self, key: str) -> dict[str, str]:
        found = self.s.get(key, "hash")
        if found is None:
            found = {}
            self.s.put(key, "hash", found)
        return found  # type: ignore[no-any-return]

    def c_HINCRBY(self, key: str, field: Any, by: Any) -> int:
        fields = self._hash(key)
        value = _int(fields.get(_text(field), 0)) + _int(by)
        fields[_text(field)] = str(value)
        return value

    def c_HSET(self, key: str, *pairs: Any) -> int:
        fields = self._hash(key)
        added = 0
        for i in range(0, len(pairs), 2):
            added += _text(pairs[i]) not in fields
            fields[_text(pairs[i])] = _text(pairs[i + 1])
        return added

    def c_HGET(self, key: str, field: Any) -> str | None:
        found: dict[str, str] = self.s.get(key, "hash") or {}
        return found.get(_text(field))

    def c_HGETALL(self, key: str) -> list[str]:
        fields = self.s.get(key, "hash") or {}
        return [part for pair in fields.items() for part in pair]

    # sorted sets
    def _zset(self, key: str, create: bool = False) -> dict[str, float]:
        found = self.s.get(key, "zset")
        if found is None:
            found = {}
            if create:
                self.s.put(key, "zset", found)
        return found  # type: ignore[no-any-return]

    def _tidy(self, key: str, members: dict[str, float]) -> None:
        if not members:
            self.s.delete(key)  # Redis keeps no empty set

    def c_ZADD(self, key: str, *pairs: Any) -> int:
        members = self._zset(key, create=True)
        added = 0
        for i in range(0, len(pairs), 2):
            member = _text(pairs[i + 1])
            added += member not in members
            members[member] = float(_text(pairs[i]))
        return added

    def c_ZREM(self, key: str, *members: Any) -> int:
        found = self._zset(key)
        removed = sum(found.pop(_text(m), None) is not None for m in members)
        self._tidy(key, found)
        return removed

    def c_ZCARD(self, key: str) -> int:
        return len(self._zset(key))

    def c_ZSCORE(self, key: str, member: Any) -> str | None:
        score = self._zset(key).get(_text(member))
        return None if score is None else _text(int(score) if score.is_integer() else score)

    def c_ZREMRANGEBYSCORE(self, key: str, low: Any, high: Any) -> int:
        (lo, lo_open), (hi, hi_open) = _score(low), _score(high)
        found = self._zset(key)
        gone = [m for m, s in found.items()
                if (s > lo if lo_open else s >= lo) and (s < hi if hi_open else s <= hi)]
        for member in gone:
            del found[member]
        self._tidy(key, found)
        return len(gone)

    # scripts
    def c_EVAL(self, script: str, count: Any, *rest: Any) -> Any:
        keys, argv = rest[:_int(count)], rest[_int(count):]
        if script is limits.SCRIPT:
            return self._limits(*keys, *argv)
        if script is pins.CLAIM:
            return self._claim(*keys, *argv)
        raise NotImplementedError("MemoryLink runs only the limits and pin-claim scripts")

    def _claim(self, pin: str, turns: str, ttl: Any, *candidates: Any) -> Any:
        """``pins.CLAIM``, line for line."""
        held = self.c_GET(pin)
        if held is not None:
            self.c_PEXPIRE(pin, ttl)
            return held
        if not candidates:
            return None
        turn = self.c_INCR(turns)
        self.c_PEXPIRE(turns, ttl)
        chosen = _text(candidates[(turn - 1) % len(candidates)])
        self.c_SET(pin, chosen, "PX", ttl)
        return [chosen]

    def _limits(self, requests: str, tokens: str, running: str, rpm: Any, tpm: Any,
                est: Any, conc: Any, member: Any, now: Any, stale: Any, ttl: Any) -> str:
        """``limits.SCRIPT``, line for line."""
        rpm, tpm, est, conc = _int(rpm), _int(tpm), _int(est), _int(conc)
        now, stale, ttl = _int(now), _int(stale), _int(ttl)
        if rpm > 0 and _int(self.c_GET(requests) or 0) >= rpm:
            return "rpm"
        used = _int(self.c_GET(tokens) or 0)
        if tpm > 0 and used > 0 and used + est > tpm:
            return "tpm"
        if conc > 0:
            self.c_ZREMRANGEBYSCORE(running, "-inf", now - stale)
            if self.c_ZCARD(running) >= conc:
                return "concurrency"
            self.c_ZADD(running, now, member)
            self.c_PEXPIRE(running, stale)
        if rpm > 0:
            self.c_INCR(requests)
            self.c_PEXPIRE(requests, ttl)
        if tpm > 0:
            self.c_INCRBY(tokens, est)
            self.c_PEXPIRE(tokens, ttl)
        return "ok"


class Pipeline:
    """redis-py's pipeline, for the calls the canary sync queues on it."""

    def __init__(self, client: MemoryClient) -> None:
        self._client = client
        self._queued: list[Callable[[], Awaitable[Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., Pipeline]:
        method = getattr(self._client, name)

        def queue(*args: Any, **kwargs: Any) -> Pipeline:
            self._queued.append(lambda: method(*args, **kwargs))
            return self

        return queue

    async def execute(self) -> list[Any]:
        queued, self._queued = self._queued, []
        return [await call() for call in queued]


class MemoryClient:
    """The redis-py methods (``decode_responses=True``) that the gateway's ``call(op)`` uses,
    answering as redis-py does (True for OK, bool for an expiry, a dict for HGETALL)."""

    def __init__(self, commands: Commands) -> None:
        self._c = commands

    def _run(self, *args: Any) -> Any:
        return self._c.run(args)

    async def get(self, key: str) -> str | None:
        return self._run("GET", key)  # type: ignore[no-any-return]

    async def mget(self, keys: Sequence[str]) -> list[str | None]:
        return self._run("MGET", *keys)  # type: ignore[no-any-return]

    async def set(self, key: str, value: Any, *, px: int | None = None, ex: int | None = None,
                  nx: bool = False, xx: bool = False, get: bool = False) -> Any:
        options: list[Any] = [*(("NX",) if nx else ()), *(("XX",) if xx else ()),
                              *(("GET",) if get else ()), *(("PX", px) if px else ()),
                              *(("EX", ex) if ex else ())]
        result = self._run("SET", key, value, *options)
        return result if get else (True if result == "OK" else None)

    async def delete(self, *keys: str) -> int:
        return self._run("DEL", *keys)  # type: ignore[no-any-return]

    async def pexpire(self, key: str, ms: int) -> bool:
        return bool(self._run("PEXPIRE", key, ms))

    async def expire(self, key: str, seconds: int) -> bool:
        return bool(self._run("EXPIRE", key, seconds))

    async def pttl(self, key: str) -> int:
        return self._run("PTTL", key)  # type: ignore[no-any-return]

    async def incr(self, key: str) -> int:
        return self._run("INCR", key)  # type: ignore[no-any-return]

    async def hincrby(self, key: str, field: str, by: int = 1) -> int:
        return self._run("HINCRBY", key, field, by)  # type: ignore[no-any-return]

    async def hgetall(self, key: str) -> dict[str, str]:
        flat = self._run("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2], strict=True))

    async def ping(self) -> bool:
        return True

    def pipeline(self, transaction: bool = True) -> Pipeline:
        return Pipeline(self)

    async def aclose(self) -> None:
        pass


class MemoryLink:
    """``RedisLink``'s interface over a ``Store``: ``execute``, ``soon``, ``claim``, ``call``,
    ``available``/``up``, ``prefix`` and ``client``. ``down = True``: Redis is away (every
    call answers unanswered at once); ``broken``: command names that answer an error (the
    command alone failed). ``sent`` lists every command run, in order."""

    def __init__(self, prefix: str = "t:", clock: Callable[[], float] | None = None) -> None:
        self.prefix = prefix
        self.clock = clock if clock is not None else Clock()
        self.store = Store(self.clock)
        self._commands = Commands(self.store)
        self.client = MemoryClient(self._commands)
        self.down = False
        self.broken: set[str] = set()
        self.sent: list[Command] = []
        self._chores: set[asyncio.Future[Any]] = set()

    @property
    def available(self) -> bool:
        return not self.down

    @property
    def up(self) -> bool:
        return not self.down

    def open(self) -> None:
        self.down = False

    async def warm(self, within: float = 5.0) -> None:
        pass

    def run(self, *args: Any) -> Any:
        """One command, at once (a test's own look at the state), as ``execute`` answers it."""
        if isinstance(args[-1], dict):  # redis-py parser options: no meaning here
            args = args[:-1]
        self.sent.append(args)
        if _text(args[0]).upper() in self.broken:
            return ReplyError(f"ERR {_text(args[0])} failed (broken on purpose)")
        try:
            return self._commands.run(args)
        except ReplyError as exc:
            return exc

    async def execute(self, *commands: Command,
                      patient: bool = False) -> tuple[bool, list[Any]]:
        if self.down:  # down here is a server that can't be reached: patience fails too
            return False, []
        await asyncio.sleep(0)  # a round trip: callers of one loop turn go together
        if self.down:
            return False, []
        return True, [self.run(*args) for args in commands]

    def soon(self, *commands: Command,
             then: Callable[[bool, list[Any]], None] | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._chore(commands, then))
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _chore(self, commands: tuple[Command, ...],
                     then: Callable[[bool, list[Any]], None] | None) -> None:
        answered, results = await self.execute(*commands)
        if then is not None:
            then(answered, results)

    async def call(self, op: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        if self.down:
            return False, None
        try:
            return True, await op()
        except ResponseError:  # the real link counts any Redis error as Redis away
            return False, None

    async def settled(self) -> None:
        """Every ``soon`` write done (the real link's are, a round trip later)."""
        while self._chores:
            await asyncio.gather(*self._chores)

    async def aclose(self) -> None:
        await self.settled()

    def __repr__(self) -> str:
        return f"<MemoryLink [{'down' if self.down else 'up'} | {len(self.store.keys())} keys]>"


def built_with(link: MemoryLink, patch: Any) -> None:
    """Have ``gateway.build`` use ``link`` for every gateway built meanwhile (``patch``: a
    pytest ``MonkeyPatch``): two gateways built so share it, as two replicas share Redis.
    The config must name a Redis URL other than ``embedded`` (nothing connects to it)."""

    def made(client: Any, prefix: str, *args: Any, **kwargs: Any) -> MemoryLink:
        link.prefix = prefix
        return link

    patch.setattr("gateway.build.RedisLink", made)


async def claim(link: Any, key: str, value: str, ttl_ms: int) -> tuple[bool, str | None]:
    """``key`` set to ``value`` unless it holds one, its TTL refreshed either way, in one
    round trip of ``link`` (real or in memory): (answered, what it held; None: stored)."""
    answered, results = await link.execute(
        ("SET", key, value, "NX", "GET", "PX", ttl_ms, {"get": True}), ("PEXPIRE", key, ttl_ms))
    if not answered or isinstance(results[0], Exception):
        return False, None
    return True, text(results[0])
