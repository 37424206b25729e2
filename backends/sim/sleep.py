"""vLLM 0.32's sleep mode, as its dev routes serve it (only with ``VLLM_SERVER_DEV_MODE=1``:
``vllm/entrypoints/serve/dev/sleep/api_router.py``, the engine's ``sleep``/``wake_up`` in
``vllm/v1/engine/core.py`` and ``vllm/v1/executor/abstract.py``):

- ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` -> ``{"status": "sleeping", "level": L}``.
  The scheduler pauses (requests are taken and wait); level 1 offloads the weights and
  drops the KV cache, level 2 discards both (the prefix cache is reset either way, an
  ``AllBlocksCleared`` event). A level or mode out of range: FastAPI's 422. Asleep already:
  nothing changes (vLLM logs a warning).
- ``POST /wake_up[?tags=weights&tags=kv_cache]`` -> ``{"status": "awake"|"sleeping",
  "tags": [...]|null}``: the tags named (all without any) wake; the scheduler resumes once
  nothing is asleep. A tag that is not asleep: nothing wakes.
- ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.
- ``POST /collective_rpc {"method": "reload_weights"}`` -> ``{"results": [null]}``: after a
  level-2 sleep the weights are gone, and a wake without this reload answers garbage
  (vllm#29341): the simulator's answers are then wrong (other tokens), as they are after
  every wake with ``--wake-garbles`` (the fault a gateway's check must catch).
- ``vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}``.

Simplified: requests in flight when it falls asleep finish (vLLM's ``mode=abort`` aborts
them; a gateway drains an instance before it sleeps it). Without ``--enable-sleep-mode``
a sleep is refused with a 500 (vLLM refuses the flag on CPU altogether).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import orjson

from backends.asgi import Receive, Scope, Send, read_body
from backends.sim.replies import error_body
from backends.sim.writer import respond

TAGS = ("weights", "kv_cache")
MODES = ("abort", "wait", "keep")
GARBLE = 7919  # added to every token's number while the answers are wrong
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


def _invalid(where: str, value: str, message: str) -> bytes:
    """FastAPI's 422 body for a query parameter it refused."""
    return orjson.dumps({"detail": [{"type": "value_error", "loc": ["query", where],
                                     "msg": message, "input": value}]})


class Sleep:
    def __init__(self, enabled: bool, wake_delay: float, garbles: bool,
                 clear: Callable[[], None]) -> None:
        self.enabled = enabled
        self.level: int | None = None  # None: awake
        self.asleep: set[str] = set()  # tags not yet woken
        self.weights_lost = False  # level 2 discarded them, and no reload since
        self.garbled = False  # the answers are wrong
        self.wakes = 0
        self._delay = wake_delay
        self._garbles = garbles
        self._clear = clear
        self._running = asyncio.Event()
        self._running.set()

    def routes(self) -> dict[str, tuple[str, Handler]]:
        return {"/sleep": ("POST", self._sleep), "/wake_up": ("POST", self._wake),
                "/is_sleeping": ("GET", self._is_sleeping),
                "/collective_rpc": ("POST", self._rpc)}

    async def until_awake(self) -> None:
        """A request waits here while the scheduler is paused."""
        await self._running.wait()

    def metrics(self, model: str) -> str:
        """vLLM's sleep-state gauge, its three series (exposition text)."""
        states = (("awake", self.level is None), ("weights_offloaded", self.level == 1),
                  ("discard_all", self.level == 2))
        return "# TYPE vllm:engine_sleep_state gauge\n" + "".join(
            f'vllm:engine_sleep_state{{engine="0",model_name="{model}",sleep_state="{state}"}}'
            f" {int(on)}\n" for state, on in states)

    async def _sleep(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        level, mode = query.get("level", ["1"])[-1], query.get("mode", ["abort"])[-1]
        if level not in ("0", "1", "2"):
            await respond(send, 422, _invalid("level", level, "Input should be 0, 1 or 2"))
            return
        if mode not in MODES:
            await respond(send, 422, _invalid("mode", mode, "Input should be 'abort', "
                                              "'wait' or 'keep'"))
            return
        if not self.enabled:
            await respond(send, 500, error_body(500, "Sleep mode is not enabled",
                                                "InternalServerError"))
            return
        if self.level is None:
            self._running.clear()
            self.level = int(level)
            if self.level >= 1:
                self.asleep = set(TAGS)
                self._clear()
            self.weights_lost = self.weights_lost or self.level == 2
        await respond(send, 200, orjson.dumps({"status": "sleeping", "level": int(level)}))

    async def _wake(self, scope: Scope, receive: Receive, send: Send) -> None:
        tags = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("tags")
        named = [t for t in tags if t != "scheduling"] if tags else None
        if self.level is not None and (named is None or set(named) <= self.asleep):
            if self._delay:
                await asyncio.sleep(self._delay)
            self.asleep -= set(named) if named is not None else self.asleep
            if not self.asleep:
                self.level = None
                self.wakes += 1
                self.garbled = self.weights_lost or self._garbles
                self._running.set()
        status = "awake" if self.level is None else "sleeping"
        await respond(send, 200, orjson.dumps({"status": status, "tags": tags}))

    async def _is_sleeping(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps({"is_sleeping": self.level is not None}))

    async def _rpc(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            method = orjson.loads(await read_body(receive) or b"{}").get("method")
        except (orjson.JSONDecodeError, AttributeError):
            method = None
        if method != "reload_weights":
            await respond(send, 400, orjson.dumps({"detail": "the simulator knows only "
                                                             "reload_weights"}))
            return
        self.weights_lost = self.garbled = False
        await respond(send, 200, orjson.dumps({"results": [None]}))
