"""vLLM's sleep mode, driven by the control plane (issue 39): the calls that put a spawned
instance to sleep, wake it, and check its answers after a wake.

vLLM serves these routes only with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``
(the launcher sets both for a backend with ``sleep_after``); the gateway never proxies them
for a client (``gateway.http.routes`` knows only the OpenAI routes).

- ``POST /sleep?level=L``: level 1 offloads the weights to host memory and frees the KV
  cache, level 2 discards both; the prefix cache is gone either way.
- A level-1 wake is one ``POST /wake_up``. A level-2 wake reloads the weights before the
  cache is woken: ``/wake_up?tags=weights``, ``/collective_rpc {"method":
  "reload_weights"}``, ``/wake_up?tags=kv_cache`` (without the reload vLLM answers
  garbage: vllm#29341).
- ``GET /is_sleeping`` confirms each end.
- The check: one short completion at temperature 0, compared with the one the same
  process gave before its first sleep (``answer``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from backends.backend import Backend

log = logging.getLogger("gateway.demand")

PROMPT = "The quick brown fox"  # any prompt: what matters is the same answer twice
CHECK_TOKENS = 8


class Sleeper:
    """``steps``: seconds a sleep, a wake or a weight reload may take (offloading or loading
    a large model's weights takes a while); ``timeout``: any other call."""

    def __init__(self, timeout: float = 30.0, steps: float = 600.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._steps = aiohttp.ClientTimeout(total=steps)
        self._session: aiohttp.ClientSession | None = None  # opened in the loop, on first use

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _call(self, backend: Backend, method: str, path: str,
                    body: dict[str, Any] | None = None, step: bool = False) -> Any:
        """vLLM's JSON answer (``{}`` for an empty 200: older vLLM answers its sleep routes
        so), or None (a refusal, a timeout, a closed port): logged."""
        try:
            async with self._client().request(
                    method, backend.url + path, json=body,
                    timeout=self._steps if step else self._timeout) as resp:
                if resp.status == 200:
                    text = await resp.read()
                    return json.loads(text) if text.strip() else {}
                log.warning("backend %s: %s %s answered %d", backend.name, method,
                            path.partition("?")[0], resp.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # JSONDecodeError too
            log.warning("backend %s: %s %s failed: %r", backend.name, method,
                        path.partition("?")[0], exc)
        return None

    async def sleeping(self, backend: Backend) -> bool | None:
        """Whether vLLM says it sleeps; None when it does not say."""
        answer = await self._call(backend, "GET", "/is_sleeping")
        return answer.get("is_sleeping") if isinstance(answer, dict) else None

    async def sleep(self, backend: Backend, level: int) -> bool:
        """Put it to sleep; True once vLLM says it sleeps."""
        if await self._call(backend, "POST", f"/sleep?level={level}", step=True) is None:
            return False
        return await self.sleeping(backend) is True

    async def wake(self, backend: Backend, level: int) -> bool:
        """Wake it by the sequence its level needs; True once vLLM says it is awake."""
        steps: list[tuple[str, dict[str, Any] | None]] = [("/wake_up", None)]
        if level == 2:
            steps = [("/wake_up?tags=weights", None),
                     ("/collective_rpc", {"method": "reload_weights"}),
                     ("/wake_up?tags=kv_cache", None)]
        for path, body in steps:
            if await self._call(backend, "POST", path, body, step=True) is None:
                return False
        return await self.sleeping(backend) is False

    async def answer(self, backend: Backend) -> str | None:
        """Its answer to the check: a short completion at temperature 0."""
        # The base model, never an adapter it lists: which adapters it lists changes
        # between the check before its first sleep and the one after a wake.
        spawn = backend.spec.spawn
        served = spawn.name_served if spawn is not None else ""
        bases = [m for m in backend.models if not (backend.cards.get(m) or {}).get("parent")]
        model = served if served in backend.models or not bases else min(bases)
        reply = await self._call(backend, "POST", "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0,
            "ignore_eos": True})
        try:
            return str(reply["choices"][0]["text"])
        except (TypeError, KeyError, IndexError):
            return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
