"""The simulator's ASGI app: vLLM's routes and bytes, with configurable timing and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from backends.asgi import Receive, Scope, Send, cancel_on_disconnect, read_body
from backends.sim import more, replies, validate
from backends.sim.bodies import Completion, first_token, prompt_bytes
from backends.sim.kvpub import KvPublisher, lifespan
from backends.sim.lora import Lora
from backends.sim.options import Fault, SimOptions
from backends.sim.prefix import PrefillQueue, PrefixCache
from backends.sim.replies import error_body
from backends.sim.sleep import GARBLE, Sleep
from backends.sim.writer import JSON, SSE, SimulatedCrash, respond, write

__all__ = ["SimApp", "SimStats", "SimulatedCrash"]

DEFAULT_MAX_MODEL_LEN = 8192  # what /v1/models reports when --max-prompt-len is off
METRICS = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
STORED = more.RESPONSES + "/"
MAX_STORED = 10_000


class _StreamEnded(Exception):
    """The response was finished early on purpose (an in-band error)."""


class SimStats:
    def __init__(self) -> None:
        self.requests = 0  # every completion/embedding request, failed ones included
        self.running = 0
        self.peak = 0  # the most requests generating at once
        self.waiting = 0  # in its own queue (beyond --capacity)
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        self.last_headers: list[tuple[str, str]] = []
        self.polled = {"/health": 0, "/metrics": 0}  # probes and scrapes, as a gateway polls

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "running": self.running, "peak": self.peak,
                "started": self.started, "completed": self.completed,
                "cancelled": self.cancelled, "last_headers": self.last_headers,
                "polled": self.polled}


class SimApp:
    def __init__(self, options: SimOptions) -> None:
        self.options = self._base = options
        self.stats = SimStats()
        self._kv = (KvPublisher(options.kv_events, options.kv_replay, options.kv_drop)
                    if options.kv_events else None)
        self.prefill = PrefillQueue()
        self.prefix = PrefixCache(options.kv_blocks, options.kv_block,
                                  self._kv.publish if self._kv is not None else None)
        self._random = random.Random(options.seed)
        self.stored: dict[str, dict[str, Any]] = {}  # the Responses API's store (in memory)
        self._slots = asyncio.Semaphore(options.capacity) if options.capacity else None
        self.sleep = Sleep(options.sleep_mode, options.wake_delay, options.wake_garbles,
                           self.prefix.clear)
        self.lora = Lora(options.enable_lora, options.max_loras, options.models, options.lora_delay)
        self._routes: dict[str, tuple[str, Handler]] = {
            validate.CHAT: ("POST", self._completion),
            validate.COMPLETIONS: ("POST", self._completion),
            validate.EMBEDDINGS: ("POST", self._embeddings),
            validate.TOKENIZE: ("POST", self._tokenize),
            validate.DETOKENIZE: ("POST", self._detokenize),
            more.RESPONSES: ("POST", self._responses),
            more.MESSAGES: ("POST", self._messages),
            **dict.fromkeys(more.AUDIO, ("POST", self._audio)),
            **dict.fromkeys((*more.RERANK, *more.SCORE, more.POOLING), ("POST", self._pooling)),
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/v1/models": ("GET", self._models),
            "/metrics": ("GET", self._metrics),
            "/sim/stats": ("GET", self._stats),
            "/sim/fault": ("POST", self._fault),
            **(self.sleep.routes() if options.dev_mode else {}),
            **(self.lora.routes() if options.runtime_lora else {}),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self._kv)
            return
        route = self._routes.get(path := scope["path"])
        if path in self.stats.polled:
            self.stats.polled[path] += 1
        if route is None and scope["path"].startswith(STORED):
            route = ("POST" if scope["path"].endswith("/cancel") else "GET", self._stored)
        if route is None:
            await respond(send, 404, replies.detail_body("Not Found"))
        elif scope["method"] != route[0]:
            await respond(send, 405, replies.detail_body("Method Not Allowed"),
                          [(b"allow", route[0].encode()), *JSON])
        else:
            await route[1](scope, receive, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", [])

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, replies.version_body())

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, replies.models_body(self.options.models, self._max_model_len(),
                                                     self.lora.cards))

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = {**self.stats.as_dict(), "lora_loads": self.lora.loads}
        await respond(send, 200, orjson.dumps(stats))

    async def _fault(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``{"set": "fault=stall,after=2"}`` (the x-sim syntax) applies to every request
        from now on, over the start options; ``{"set": ""}`` restores them."""
        raw = await read_body(receive)
        try:
            spec = str(orjson.loads(raw or b"{}").get("set", ""))
            self.options = self._base.override(spec)
        except (ValueError, AttributeError) as exc:
            await respond(send, 400, error_body(400, str(exc), "BadRequestError"))
            return
        await respond(send, 200, orjson.dumps({"set": spec}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        label = f'{{model_name="{self.options.models[0]}"}}'
        lines = [
            ("vllm:num_requests_running", "gauge", self.stats.running),
            ("vllm:num_requests_waiting", "gauge", self.stats.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", round(self.prefix.usage, 6)),
            ("vllm:prefix_cache_queries_total", "counter", self.prefix.queries),
            ("vllm:prefix_cache_hits_total", "counter", self.prefix.hits),
        ]
        text = "".join(f"# TYPE {name} {kind}\n{name}{label} {value}\n"
                       for name, kind, value in lines) + self.sleep.metrics(
            self.options.models[0]) + self.lora.metrics()
        await respond(send, 200, text.encode(), METRICS)

    def _max_model_len(self, opts: SimOptions | None = None) -> int:
        return (opts or self.options).max_prompt_len or DEFAULT_MAX_MODEL_LEN

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> dict[str, Any] | None:
        """The body vLLM would accept, or None once the rejection has been answered."""
        raw = await read_body(receive)
        if raw is None:
            return None
        content_type = ""
        for key, value in scope["headers"]:
            if key == b"content-type":
                content_type = value.decode("latin-1")
        parsed = validate.parse(scope["path"], content_type, raw)
        if isinstance(parsed, dict):
            rejected = validate.check_model(scope["path"], parsed,
                                            (*self.options.models, *self.lora.loaded))
            if rejected is None:
                parsed.setdefault("model", None)
                parsed["model"] = parsed["model"] or self.options.models[0]
                return parsed
            parsed = rejected
        await respond(send, parsed.status, parsed.body)
        return None

    async def _prepare(
        self, scope: Scope, receive: Receive, send: Send
    ) -> tuple[dict[str, Any], SimOptions] | None:
        """Read and check a request, roll its faults; answer errors itself and return None."""
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        self.stats.last_headers = headers
        self.stats.requests += 1
        body = await self._read(scope, receive, send)
        if body is None:
            return None
        opts = self.options.for_model(body["model"])
        try:
            for key, value in headers:
                if key == "x-sim":
                    opts = opts.override(value)
        except ValueError as exc:
            await respond(send, 400, error_body(400, str(exc), "BadRequestError"))
            return None
        roll = self._random.random()
        if opts.fault is Fault.ERROR or roll < opts.error_rate:
            await respond(send, 500, error_body(500, "simulated failure", "InternalServerError"))
            return None
        if opts.fault is Fault.BUSY or roll < opts.error_rate + opts.busy_rate:
            busy = [*JSON, (b"retry-after", str(opts.retry_after).encode())]
            await respond(send, 503, error_body(503, "server busy", "ServiceUnavailableError"),
                          busy)
            return None
        return body, opts

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, opts = prepared
        prompt = prompt_bytes(scope["path"], body)
        if opts.max_prompt_len and len(prompt) > opts.max_prompt_len:
            await respond(send, 400, replies.too_long(opts.max_prompt_len, len(prompt)))
            return
        cached = self.prefix.observe(prompt)
        n_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or opts.tokens
        completion = Completion(chat=scope["path"] == validate.CHAT, model=str(body["model"]),
                                prompt_tokens=len(prompt), n_tokens=int(n_tokens),
                                first=first_token(body) + GARBLE * self.sleep.garbled
                                + self.lora.shift(body["model"]),
                                cached=cached if opts.token_details else None)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        watcher = cancel_on_disconnect(receive)
        try:
            await self.sleep.until_awake()  # vLLM's scheduler is paused while it sleeps
            if self._slots is not None:
                self.stats.waiting += 1
                try:
                    await self._slots.acquire()  # queued behind the requests generating
                finally:
                    self.stats.waiting -= 1
            if opts.prefill_rate:  # the first token after the prefill queued and its own
                wait = self.prefill.wait(len(prompt) - cached[0], opts.prefill_rate)
                opts = dataclasses.replace(opts, ttft=opts.ttft + wait)
            async with self.lora.slot(completion.model, self.stats):
                await self._generate(send, body, completion, opts, usage)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            task = asyncio.current_task()
            if task is not None and watcher.done() and task.uncancel() == 0:
                return
            raise
        finally:
            watcher.cancel()

    async def _generate(self, send: Send, body: dict[str, Any], completion: Completion,
                        opts: SimOptions, usage: bool) -> None:
        self.stats.running += 1
        self.stats.peak = max(self.stats.peak, self.stats.running)
        self.stats.started += 1
        try:
            if body.get("stream"):
                await self._stream(send, completion, opts, usage)
            else:
                await asyncio.sleep(opts.ttft + opts.itl * (completion.n_tokens - 1))
                await self._whole(send, completion.whole(), opts)
            self.stats.completed += 1
        except _StreamEnded:
            self.stats.completed += 1
        finally:
            self.stats.running -= 1
            if self._slots is not None:
                self._slots.release()

    async def _whole(self, send: Send, body: bytes, opts: SimOptions) -> None:
        cut = opts.after if opts.fault is Fault.CUT else None
        await respond(send, 200, body, split=opts.split, cut=cut)

    async def _stream(
        self, send: Send, completion: Completion, opts: SimOptions, usage: bool
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if opts.ttft:
            await asyncio.sleep(opts.ttft)
        events = 0

        async def emit(data: bytes) -> None:
            nonlocal events
            if opts.fault is not Fault.NONE and events == opts.after:
                await self._strike(send, opts)
            await write(send, data, opts.split, more=True)
            events += 1

        if completion.chat:
            await emit(completion.role_chunk())
        last = completion.n_tokens - 1
        for i in range(completion.n_tokens):
            if i and opts.itl:
                await asyncio.sleep(opts.itl)
            await emit(completion.last_chunk(usage) if i == last else completion.token_chunk(i))
        if usage:
            await emit(completion.usage_chunk())
        if opts.fault in (Fault.CRASH, Fault.CUT) and opts.after in (events, events + 1):
            if opts.after > events:  # the client has [DONE], then the connection drops
                await write(send, b"data: [DONE]\n\n", opts.split, more=True)
            raise SimulatedCrash
        await write(send, b"data: [DONE]\n\n", opts.split)

    async def _strike(self, send: Send, opts: SimOptions) -> None:
        if opts.fault in (Fault.CRASH, Fault.CUT):
            raise SimulatedCrash
        if opts.fault is Fault.INBAND:
            event = replies.streaming_error(500, "simulated in-band failure", "InternalServerError")
            await send({"type": "http.response.body", "body": event})
            raise _StreamEnded
        if opts.fault is Fault.STALL:
            await asyncio.sleep(opts.stall)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, opts = prepared
        reply = replies.embeddings_body(str(body["model"]), replies.inputs(body.get("input", "")),
                                        body.get("encoding_format", "float"),
                                        str(body.get("endianness", "native")))
        await self._whole(send, reply, opts)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read(scope, receive, send)
        if body is not None:
            opts = self.options.for_model(body["model"])
            reply = replies.tokenize_body(prompt_bytes(scope["path"], body),
                                          self._max_model_len(opts),
                                          bool(body.get("return_token_strs")))
            await respond(send, 200, reply)

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read(scope, receive, send)
        if body is not None:
            await respond(send, 200, replies.detokenize_body([int(t) for t in body["tokens"]]))

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, opts = prepared
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            await respond(send, 404, more.response_not_found(str(previous)))
            return
        n = int(body.get("max_output_tokens") or opts.tokens)
        done = more.response(body, n, len(orjson.dumps(body.get("input", ""))))
        if body.get("store", True):
            if len(self.stored) >= MAX_STORED:
                self.stored.pop(next(iter(self.stored)))
            self.stored[done["id"]] = done
        await asyncio.sleep(opts.ttft)
        if not body.get("stream"):
            await self._whole(send, orjson.dumps(done), opts)
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for event in more.response_events(done, n):
            await write(send, event, opts.split, more=True)
        await write(send, b"", opts.split)

    async def _stored(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
        response_id = scope["path"][len(STORED):].removesuffix("/cancel")
        found = self.stored.get(response_id)
        if found is None:
            await respond(send, 404, more.response_not_found(response_id))
        elif scope["path"].endswith("/cancel"):  # every simulated response is synchronous
            await respond(send, 400, error_body(400, "Cannot cancel a synchronous response.",
                                                "invalid_request_error", "response_id"))
        else:
            await respond(send, 200, orjson.dumps(found))

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is not None:
            body, opts = prepared
            prompt = len(orjson.dumps(body.get("messages")))
            await asyncio.sleep(opts.ttft)
            await self._whole(send, more.message_body(
                str(body["model"]), int(body.get("max_tokens") or opts.tokens), prompt), opts)

    async def _audio(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is not None:
            body, opts = prepared
            await self._whole(send, more.audio_body(scope["path"], int(body["file"])), opts)

    async def _pooling(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, opts = prepared
        path, model = scope["path"], str(body["model"])
        if path in more.RERANK:
            reply = more.rerank_body(model, str(body["query"]), more.texts(body["documents"]),
                                     body.get("top_n"))
        elif path in more.SCORE:
            first = body.get("text_1", body.get("queries", body.get("data_1")))
            second = body.get("text_2", body.get("documents", body.get("data_2")))
            reply = more.score_body(model, more.texts(first)[0], more.texts(second))
        else:
            reply = more.pooling_body(model, more.texts(body["input"]))
        await self._whole(send, reply, opts)

