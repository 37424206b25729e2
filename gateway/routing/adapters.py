"""LoRA adapters on their base model's instances (issue 41): which instances can serve an
adapter, which of them have it loaded, and loading it where a request goes.

An adapter is asked for by name like a model. Its candidates are the instances of its base
that serve LoRA (``BackendSpec.serves_lora``); those that have it loaded come first while
one of them has room (its own ``/v1/models`` lists it, or this process loaded it there
lately; those running it now before them, by vLLM's ``lora_requests_info``, then those
with a free adapter slot), so that one adapter's traffic does not make every instance
swap adapters in and out. Loading is vLLM's ``/v1/load_lora_adapter``, once per instance
and adapter at a time: concurrent requests wait for the same load. What this process
loaded counts for ``TRUST`` seconds; after that the instance's own ``/v1/models`` says
(scraped every health interval), so an instance that restarted (a url backend's too) has
its adapter loaded again by the next request. No path from a client ever reaches an
instance: only declared adapters are loaded, from their declared path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import orjson

from backends.backend import Backend
from gateway.config.adapters import AdapterSpec
from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.upstream import Upstream, UpstreamError

log = logging.getLogger("gateway.adapters")

LOADED = b"has already been loaded"  # vLLM's 400 for a name loaded before (by any worker)
TRUST = 15.0  # seconds a load this process made counts without the instance listing it
LOAD_TIMEOUT = 120.0  # seconds a load may take (vLLM reads the weights)
SPILL, SLACK = 2.0, 2  # room: a queue up to SPILL x the least busy candidate's + SLACK
Life = tuple[str, int | None, int]  # an instance's run: (backend, pid, restarts)


class AdapterRefused(GatewayError):
    """vLLM would not load a declared adapter (its path, its rank, its base): the
    operator's to fix, not the instance's fault, so no breaker counts it."""

    status = 503
    kind = "service_unavailable"
    code = "adapter_unavailable"


def _life(backend: Backend) -> Life:
    return backend.name, backend.pid, backend.restarts


def _room(backend: Backend, least: float) -> bool:
    """``backend`` can take one more of the adapter's requests: below its capacity, and
    nothing waiting in vLLM's queue or not much busier than the least busy candidate
    (``least``: its queue). Not "nothing waiting" alone: vLLM's waiting queue also holds
    the requests of adapters that found no free slot in the batch (``--max-loras``), so
    with several adapters in turn every instance has some waiting, and yielding then
    spread each adapter over every instance (an H100, 4 instances, 16 adapters: 3.5
    instances per adapter, TTFT p50 5.2 s)."""
    if backend.capacity and backend.in_flight >= backend.capacity:
        return False
    idle = backend.load is None or backend.load.waiting == 0
    return idle or backend.queue <= SPILL * least + SLACK


def _loras(backend: Backend) -> tuple[str, ...]:
    """The adapters ``backend``'s batches run now. vLLM sets ``lora_requests_info`` only
    at an engine step: an idle instance keeps saying its last step's, so none then."""
    load = backend.load
    return load.loras_running if load is not None and load.running else ()


def _running(backend: Backend, name: str) -> bool:
    return name in _loras(backend)


def _free_slot(backend: Backend, name: str) -> bool:
    load = backend.load
    return (load is not None and load.max_loras is not None
            and len(_loras(backend)) < load.max_loras)


async def _post(backend: Backend, path: str, body: bytes,
                upstream: Upstream) -> tuple[int, bytes]:
    """One of vLLM's adapter routes on ``backend``: its status and (up to 64 KiB) answer."""
    headers = [(b"content-type", b"application/json")]  # the client sets the length
    if backend.spec.api_key is not None:
        token = backend.spec.api_key.get_secret_value()
        headers.append((b"authorization", b"Bearer " + token.encode()))
    async with asyncio.timeout(LOAD_TIMEOUT):
        reply = await upstream.request("POST", backend.url + path, headers, body)
        answer = b""
        try:
            while len(answer) < 65536 and (chunk := await reply.read()):
                answer += chunk
        finally:
            await reply.aclose(reuse=len(answer) < 65536)
    return reply.status, answer


class Adapters:
    def __init__(self, specs: Sequence[AdapterSpec] = (), metrics: Metrics | None = None,
                 affinity: bool = True) -> None:
        self.specs: dict[str, AdapterSpec] = {}
        self.retired: set[str] = set()
        self.declare(specs, affinity)
        self._metrics = metrics
        self._loaded: dict[Life, dict[str, float]] = {}  # this process's loads: name -> when
        self._loading: dict[tuple[Life, str], asyncio.Future[bool | None]] = {}
        self.loads: Counter[tuple[str, str, str]] = Counter()  # (backend, adapter, result)

    def declare(self, specs: Sequence[AdapterSpec], affinity: bool = True) -> None:
        """The ``[[adapters]]`` (at start and at each reload). One a reload removes is
        ``retired``: no longer routed nor listed, and unloaded (``tend``) while any
        instance still lists it, until it is declared again."""
        new = {a.name: a for a in specs}
        self.retired = (self.retired | (self.specs.keys() - new.keys())) - new.keys()
        self.specs = new
        self.affinity = affinity  # routing.adapter_affinity: ``prefer`` orders, or not

    def __bool__(self) -> bool:
        return bool(self.specs)

    def base(self, name: str) -> str | None:
        spec = self.specs.get(name)
        return spec.base if spec is not None else None

    def serves(self, backend: Backend, name: str) -> bool:
        """``backend`` can serve adapter ``name``: it has it, or serves its base with LoRA."""
        spec = self.specs[name]
        return backend.serves(name) or (backend.spec.serves_lora and backend.serves(spec.base))

    def on(self, backend: Backend, name: str) -> bool:
        """``backend`` has adapter ``name`` loaded, or is loading it (as far as this
        process knows): a burst of an adapter's first requests goes where it loads."""
        if backend.serves(name):
            return True
        life = _life(backend)
        loaded = self._loaded.get(life, {}).get(name)
        return ((loaded is not None and time.monotonic() - loaded < TRUST)
                or (life, name) in self._loading)

    def prefer(self, found: list[Backend], name: str) -> list[Backend]:
        """The candidates for adapter ``name``: those running it now (vLLM's
        ``lora_requests_info``: it holds one of their batch's adapter slots), else those
        that have it loaded, else those with a free adapter slot; the first of these of
        which one has room (``_room``), else all (the policy balances among them). Without
        ``affinity``, all."""
        if not self.affinity or not found:
            return found
        least = min(b.queue for b in found)
        for tier in (_running, self.on, _free_slot):
            chosen = [b for b in found if tier(b, name)]
            if any(_room(b, least) for b in chosen):
                return chosen
        return found

    async def ensure(self, backend: Backend, name: str, upstream: Upstream) -> bool:
        """Adapter ``name`` loaded on ``backend`` (loading it now if it is not): True once
        it is; False when the instance could not be reached (another may be tried).
        Raises ``AdapterRefused`` when vLLM answered that it will not load it."""
        life = _life(backend)
        loading = self._loading.get((life, name))
        if loading is None:
            if self.on(backend, name):
                return True
            spec = self.specs[name]
            loading = asyncio.ensure_future(self._load(backend, spec, upstream, life))
            self._loading[life, name] = loading
            loading.add_done_callback(lambda _: self._loading.pop((life, name), None))
        loaded = await asyncio.shield(loading)
        if loaded is None:
            raise AdapterRefused(f"adapter {name} could not be loaded; retry later")
        return loaded

    async def _load(self, backend: Backend, spec: AdapterSpec, upstream: Upstream,
                    life: Life) -> bool | None:
        """True: loaded; False: no answer in time; None: vLLM refused it."""
        name = spec.name
        body = orjson.dumps({"lora_name": name, "lora_path": spec.path})
        began = time.monotonic()
        try:
            status, answer = await _post(backend, "/v1/load_lora_adapter", body, upstream)
        except (UpstreamError, TimeoutError) as exc:
            log.warning("backend %s: adapter %s not loaded: %s", backend.name, name,
                        exc or type(exc).__name__)
            self._count(backend, name, "failed")
            return False
        if status == 200 or (status == 400 and LOADED in answer):
            self._loaded.setdefault(life, {})[name] = time.monotonic()
            for old in [k for k in self._loaded if k[0] == life[0] and k != life]:
                del self._loaded[old]  # an earlier run of that instance: forgotten
            if status == 400:  # another worker loaded it: not a load of the instance's
                self._count(backend, name, "present")
                return True
            took = time.monotonic() - began
            self._count(backend, name, "loaded")
            if self._metrics is not None:
                self._metrics.adapter_load_time.labels(name).observe(took)
            log.info("backend %s: adapter %s loaded in %.2f s", backend.name, name, took)
            return True
        log.warning("backend %s: adapter %s not loaded: vLLM answered %d", backend.name,
                    name, status)
        self._count(backend, name, "refused")
        return None

    async def upkeep(self, backends: Callable[[], Sequence[Backend]], upstream: Upstream,
                     every: float) -> None:
        """Every ``every`` seconds (a serving process): ``tend``."""
        while True:
            try:
                await self.tend(backends(), upstream)
            except Exception:  # a bad round must not end the upkeep
                log.exception("adapters: preloads and unloads of this round failed")
            await asyncio.sleep(every)

    async def tend(self, backends: Sequence[Backend], upstream: Upstream) -> None:
        """Adapters with ``preload`` loaded on every routable LoRA instance of their base
        that has not got them (one started, or restarted, since); adapters a reload
        removed unloaded from the instances that still list them, or where this process
        loaded them."""
        jobs = []
        for backend in backends:
            if not (backend.routable and backend.spec.serves_lora):
                continue
            jobs += [self._preload(backend, name, upstream)
                     for name, spec in self.specs.items()
                     if spec.preload and backend.serves(spec.base)
                     and not self.on(backend, name)]
            jobs += [self._unload(backend, name, upstream) for name in self.retired
                     if backend.serves(name) or name in self._loaded.get(_life(backend), {})]
        await asyncio.gather(*jobs)
        for name in list(self.retired):  # unloaded everywhere: no longer watched
            if not any(b.serves(name) or name in self._loaded.get(_life(b), {})
                       for b in backends):
                self.retired.discard(name)

    async def _preload(self, backend: Backend, name: str, upstream: Upstream) -> None:
        with contextlib.suppress(AdapterRefused):  # said and counted: tried again later
            await self.ensure(backend, name, upstream)

    async def _unload(self, backend: Backend, name: str, upstream: Upstream) -> None:
        try:
            status, _ = await _post(backend, "/v1/unload_lora_adapter",
                                    orjson.dumps({"lora_name": name}), upstream)
        except (UpstreamError, TimeoutError):
            status = 0
        done = status in (200, 404)  # 404: not there (another worker unloaded it)
        if done:
            self._loaded.get(_life(backend), {}).pop(name, None)
            log.info("backend %s: adapter %s, removed from the config, unloaded",
                     backend.name, name)
        if self._metrics is not None:
            self._metrics.adapter_unloads.labels(
                backend.name, name, "unloaded" if done else "failed").inc()

    def _count(self, backend: Backend, name: str, result: str) -> None:
        self.loads[backend.name, name, result] += 1
        if self._metrics is not None:
            self._metrics.adapter_loads.labels(backend.name, name, result).inc()
