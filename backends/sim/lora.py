"""vLLM 0.32's LoRA adapters loaded at runtime, as its API server serves them (only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``: ``vllm/entrypoints/serve/lora/api_router.py`` and
``vllm/entrypoints/openai/models/serving.py``):

- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` -> 200 with the plain text
  ``Success: LoRA adapter 'NAME' added successfully.`` (no content type). Either field
  missing or empty, a name that is a base model, or a name loaded already: a 400
  ``InvalidUserInput``; a path without an adapter: a 404 ``NotFoundError``. Without
  ``--enable-lora`` the engine refuses it (a 500).
- ``POST /v1/unload_lora_adapter {"lora_name"}`` -> 200 ``Success: LoRA adapter 'NAME'
  removed successfully.``; a name not loaded: a 404 ``NotFoundError``.
- ``/v1/models`` lists each loaded adapter after the base models: ``root`` its path,
  ``parent`` the base model; a request names an adapter as its ``model``.
- ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``: a
  gauge whose labels name the adapters of the requests running and waiting (comma
  separated), its value the time it was set.
- A batch runs at most ``--max-loras`` adapters at once: the scheduler leaves a request
  whose adapter would be one more in the waiting queue (``vllm/v1/core/sched/scheduler.py``)
  until a running adapter's last request ends (``Lora.slot``).

An adapter's answers differ from the base model's and from every other adapter's (its
tokens are shifted by a number drawn from its name), as a random-weight adapter's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.asgi import Receive, Scope, Send, read_body
from backends.sim.replies import error_body
from backends.sim.writer import respond


class Lora:
    def __init__(self, enabled: bool, max_loras: int, bases: tuple[str, ...],
                 delay: float = 0.0) -> None:
        self.enabled = enabled
        self.delay = delay  # seconds a load takes (vLLM reads the weights)
        self.max_loras = max_loras
        self.bases = bases
        self.loaded: dict[str, str] = {}  # name -> path, in load order
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()  # requests waiting for a batch slot
        self._turn = asyncio.Condition()
        self.loads = 0  # load requests, refused ones too

    def routes(self) -> dict[str, tuple[str, Any]]:
        return {"/v1/load_lora_adapter": ("POST", self._load),
                "/v1/unload_lora_adapter": ("POST", self._unload)}

    def shift(self, model: str | None) -> int:
        """What an adapter adds to every token's number (0 for a base model)."""
        if model is None or model not in self.loaded:
            return 0
        return 1 + zlib.crc32(model.encode()) % 9973

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "vllm",
                 "root": path, "parent": self.bases[0], "max_model_len": None}
                for name, path in self.loaded.items()]

    def _fits(self, model: str) -> bool:
        """A request for ``model`` may join the batch: a base model, or an adapter that
        runs already or finds a free slot."""
        if model not in self.loaded:
            return True
        busy = sum(1 for name, c in self.running.items() if c > 0 and name in self.loaded)
        return self.running[model] > 0 or busy < self.max_loras

    @contextlib.asynccontextmanager
    async def slot(self, model: str, waited: Any) -> AsyncIterator[None]:
        """Held while a request for ``model`` generates; waits first (counted in
        ``waited.waiting``, vLLM's waiting queue) while its adapter finds no batch slot."""
        async with self._turn:
            if not self._fits(model):
                self.waiting[model] += 1
                waited.waiting += 1
                try:
                    await self._turn.wait_for(lambda: self._fits(model))
                finally:
                    self.waiting[model] -= 1
                    waited.waiting -= 1
            self.running[model] += 1
        try:
            yield
        finally:
            self.running[model] -= 1
            if not self.running[model]:
                async with self._turn:
                    self._turn.notify_all()

    def metrics(self) -> str:
        if not self.enabled:
            return ""
        running, waiting = (",".join(sorted(n for n, c in count.items() if c > 0 and n in
                                            self.loaded)) for count in (self.running, self.waiting))
        return ("# TYPE vllm:lora_requests_info gauge\n"
                f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters='
                f'"{running}",waiting_lora_adapters="{waiting}"}} {time.time()}\n')

    async def _fields(self, receive: Receive, send: Send) -> dict[str, Any] | None:
        try:
            body = orjson.loads(await read_body(receive) or b"{}")
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            await respond(send, 400, error_body(400, "Invalid JSON body", "BadRequestError"))
            return None
        return body

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.loads += 1
        body = await self._fields(receive, send)
        if body is None:
            return
        name, path = body.get("lora_name"), body.get("lora_path")
        problem = (
            "Both 'lora_name' and 'lora_path' must be provided." if not name or not path
            else f"The lora adapter '{name}' conflicts with a served base model."
            if name in self.bases
            else f"The lora adapter '{name}' has already been loaded. If you want to load "
                 "the adapter in place, set 'load_inplace' to True."
            if name in self.loaded and not body.get("load_inplace") else None)
        if problem is not None:
            await respond(send, 400, error_body(400, problem, "InvalidUserInput"))
            return
        if not self.enabled:
            await respond(send, 500, error_body(500, "LoRA is not enabled",
                                                "InternalServerError"))
            return
        found = os.path.join(str(path), "adapter_config.json")
        if not await asyncio.to_thread(os.path.isfile, found):
            await respond(send, 404, error_body(
                404, f"Loading lora {name} failed: No adapter found for <path>",
                "NotFoundError"))
            return
        if self.delay:
            await asyncio.sleep(self.delay)
        self.loaded[str(name)] = str(path)
        await respond(send, 200, f"Success: LoRA adapter '{name}' added successfully."
                      .encode(), [])

    async def _unload(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._fields(receive, send)
        if body is None:
            return
        name = body.get("lora_name")
        if not name:
            await respond(send, 400, error_body(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput"))
            return
        if name not in self.loaded:
            await respond(send, 404, error_body(
                404, f"The lora adapter '{name}' cannot be found.", "NotFoundError"))
            return
        del self.loaded[name]
        await respond(send, 200, f"Success: LoRA adapter '{name}' removed successfully."
                      .encode(), [])
