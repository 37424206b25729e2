"""The simulator's ASGI app: vLLM's routes, timing and injected faults."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson

from backends.asgi import Receive, Scope, Send, cancel_on_disconnect, read_body
from backends.sim.bodies import Completion, embeddings_body, error_body, prompt_bytes
from backends.sim.options import Fault, SimOptions
from backends.sim.prefix import PrefixCache

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SimulatedCrash(Exception):
    """Raised mid-response so the server drops the connection."""


class _StreamEnded(Exception):
    """The response was finished early on purpose (an in-band error)."""


class SimStats:
    def __init__(self) -> None:
        self.requests = 0  # every completion/embedding request, failed ones included
        self.running = 0
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        self.last_headers: list[tuple[str, str]] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "running": self.running,
            "started": self.started,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "last_headers": self.last_headers,
        }


class SimApp:
    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.stats = SimStats()
        self.prefix = PrefixCache()
        self._random = random.Random(options.seed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path = scope["path"]
        method = scope["method"]
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._completion(scope, receive, send)
        elif method == "POST" and path == "/v1/embeddings":
            await self._embeddings(scope, receive, send)
        elif method == "GET" and path == "/health":
            await _respond(send, 200, b"", [])
        elif method == "GET" and path == "/v1/models":
            await _respond(send, 200, self._models(), JSON)
        elif method == "GET" and path == "/metrics":
            await _respond(send, 200, self._metrics(), [(b"content-type", b"text/plain")])
        elif method == "GET" and path == "/sim/stats":
            await _respond(send, 200, orjson.dumps(self.stats.as_dict()), JSON)
        else:
            await _respond(send, 404, error_body(404, f"no route {path}", "NotFoundError"), JSON)

    def _models(self) -> bytes:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "vllm", "root": m,
             "max_model_len": 8192}
            for m in self.options.models
        ]
        return orjson.dumps({"object": "list", "data": data})

    def _metrics(self) -> bytes:
        model = self.options.models[0]
        label = f'{{model_name="{model}"}}'
        lines = [
            ("vllm:num_requests_running", "gauge", self.stats.running),
            ("vllm:num_requests_waiting", "gauge", 0),
            ("vllm:kv_cache_usage_perc", "gauge", round(self.prefix.usage, 6)),
            ("vllm:prefix_cache_queries_total", "counter", self.prefix.queries),
            ("vllm:prefix_cache_hits_total", "counter", self.prefix.hits),
        ]
        out = []
        for name, kind, value in lines:
            out.append(f"# TYPE {name} {kind}\n{name}{label} {value}\n")
        return "".join(out).encode()

    async def _prepare(
        self, scope: Scope, receive: Receive, send: Send
    ) -> tuple[dict[str, Any], SimOptions] | None:
        """Read and check a request; answer errors itself and return None."""
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        self.stats.last_headers = headers
        self.stats.requests += 1
        raw = await read_body(receive)
        if raw is None:
            return None
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            model = body.get("model")
            if model not in self.options.models:
                msg = f"The model `{model}` does not exist."
                await _respond(send, 404, error_body(404, msg, "NotFoundError"), JSON)
                return None
            opts = self.options.for_model(model)
            for key, value in headers:
                if key == "x-sim":
                    opts = opts.override(value)
        except ValueError as exc:
            await _respond(send, 400, error_body(400, str(exc), "BadRequestError"), JSON)
            return None
        roll = self._random.random()
        if opts.fault is Fault.ERROR or roll < opts.error_rate:
            await _respond(send, 500, error_body(500, "simulated failure", "InternalServerError"),
                           JSON)
            return None
        if opts.fault is Fault.BUSY or roll < opts.error_rate + opts.busy_rate:
            headers_out = [*JSON, (b"retry-after", str(opts.retry_after).encode())]
            await _respond(send, 503, error_body(503, "server busy", "ServiceUnavailableError"),
                           headers_out)
            return None
        return body, opts

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, opts = prepared
        prompt = prompt_bytes(scope["path"], body)
        if opts.max_prompt_len and len(prompt) > opts.max_prompt_len:
            msg = (f"This model's maximum context length is {opts.max_prompt_len} tokens. "
                   f"However, you requested {len(prompt)} tokens in the messages.")
            await _respond(send, 400, error_body(400, msg, "BadRequestError"), JSON)
            return
        self.prefix.observe(prompt)
        n_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or opts.tokens
        completion = Completion(
            chat=scope["path"].endswith("/chat/completions"),
            model=str(body["model"]),
            prompt_tokens=len(prompt),
            n_tokens=int(n_tokens),
        )
        stream = bool(body.get("stream"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.stats.running += 1
        self.stats.started += 1
        watcher = cancel_on_disconnect(receive)
        try:
            if stream:
                await self._stream(send, completion, opts, usage)
            else:
                await asyncio.sleep(opts.ttft + opts.itl * max(completion.n_tokens - 1, 0))
                await _respond(send, 200, completion.whole(), JSON)
            self.stats.completed += 1
        except _StreamEnded:
            self.stats.completed += 1
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            task = asyncio.current_task()
            if task is not None and watcher.done() and task.uncancel() == 0:
                return
            raise
        finally:
            watcher.cancel()
            self.stats.running -= 1

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
            await send({"type": "http.response.body", "body": data, "more_body": True})
            events += 1

        if completion.chat:
            await emit(completion.role_chunk())
        for i in range(completion.n_tokens):
            if i and opts.itl:
                await asyncio.sleep(opts.itl)
            await emit(completion.token_chunk(i))
        await emit(completion.final_chunk())
        if usage:
            await emit(completion.usage_chunk())
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _strike(self, send: Send, opts: SimOptions) -> None:
        if opts.fault is Fault.CRASH:
            raise SimulatedCrash
        if opts.fault is Fault.INBAND:
            event = b"data: " + error_body(500, "simulated in-band failure", "InternalServerError")
            await send({"type": "http.response.body", "body": event + b"\n\n"})
            raise _StreamEnded
        if opts.fault is Fault.STALL:
            await asyncio.sleep(opts.stall)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = await self._prepare(scope, receive, send)
        if prepared is None:
            return
        body, _ = prepared
        inputs = body.get("input", "")
        items = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
        await _respond(send, 200, embeddings_body(str(body["model"]), items), JSON)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
