"""Each backend's own view of its load, scraped from vLLM's /metrics on an interval, and
its GPUs read through NVML where there are any (absent, not faked, where there are none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from backends.backend import Backend, GpuReading, LoadReport

log = logging.getLogger("backends.load")

WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # before vLLM 0.10
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
}


LORA_INFO = "vllm:lora_requests_info{"
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def lora_info(text: str) -> tuple[tuple[str, ...], int | None]:
    """The adapters of the requests running and ``max_lora``, from the newest sample of
    ``vllm:lora_requests_info`` (each set of labels is a sample of its own, its value the
    time vLLM set it); ``((), None)`` when the instance has no LoRA."""
    newest, labels = -1.0, ""
    for line in text.splitlines():
        if line.startswith(LORA_INFO):
            head, _, value = line.rpartition("} ")
            with contextlib.suppress(ValueError):
                if float(value.split(" ", 1)[0]) > newest:
                    newest, labels = float(value.split(" ", 1)[0]), head
    if newest < 0:
        return (), None
    found = dict(LABEL.findall(labels))
    running = tuple(n for n in found.get("running_lora_adapters", "").split(",") if n)
    limit = found.get("max_lora", "")
    return running, int(limit) if limit.isdigit() else None


def read(text: str) -> tuple[dict[str, float], tuple[tuple[str, ...], int | None]]:
    return parse(text), lora_info(text)


def parse(text: str) -> dict[str, float]:
    """The wanted samples of a Prometheus text page, summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = WANTED.get(name)
        if key is None:
            continue
        with contextlib.suppress(ValueError, IndexError):
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Nvml:
    """GPU memory and temperature through nvidia-ml-py; ``available`` is False without a
    GPU or a driver, and then nothing is reported."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no package, no driver, no GPU: all mean "no readings"
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self, indices: Sequence[int]) -> tuple[GpuReading, ...]:
        nv = self._nvml
        if nv is None:
            return ()
        out = []
        for i in indices:
            with contextlib.suppress(Exception):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                memory = nv.nvmlDeviceGetMemoryInfo(handle)
                temp = nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
                out.append(GpuReading(i, int(memory.used), int(memory.total), int(temp)))
        return tuple(out)


class LoadScraper:
    def __init__(self, backends: Sequence[Backend], session: aiohttp.ClientSession,
                 interval: float, timeout: float, nvml: Nvml | None = None,
                 on_update: Callable[[Backend], None] | None = None) -> None:
        self._backends = backends
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._nvml = nvml
        self._on_update = on_update
        self._prefix: dict[str, tuple[float, float]] = {}  # name -> (queries, hits)

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._interval)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(b) for b in list(self._backends)))

    async def scrape(self, backend: Backend) -> None:
        try:
            async with self._session.get(backend.url + "/metrics",
                                         timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return  # the health checks judge liveness; a missed scrape keeps the last one
        values, (loras, max_loras) = await asyncio.to_thread(read, text)
        gpus: tuple[GpuReading, ...] = ()
        indices = backend.spec.monitored_gpus
        if self._nvml is not None and self._nvml.available and indices:
            gpus = await asyncio.to_thread(self._nvml.read, indices)
        backend.load = LoadReport(
            running=values.get("running", 0.0), waiting=values.get("waiting", 0.0),
            kv_usage=values.get("kv_usage"), prefix_hit_ratio=self._hit_ratio(backend, values),
            gpus=gpus, loras_running=loras, max_loras=max_loras)
        if self._on_update is not None:
            self._on_update(backend)

    def _hit_ratio(self, backend: Backend, values: dict[str, float]) -> float | None:
        if "queries" not in values:
            return None
        now = (values["queries"], values.get("hits", 0.0))
        before = self._prefix.get(backend.name)
        self._prefix[backend.name] = now
        if before is None or now[0] <= before[0]:
            return None
        return (now[1] - before[1]) / (now[0] - before[0])
