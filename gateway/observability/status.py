"""The live picture of the gateway: gauges refreshed from the backends' state, and the JSON
the status page (``/dashboard``) draws."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from backends.backend import Backend, BackendState
from backends.supervisor import Supervisor
from gateway.canary.rollout import Canary
from gateway.kv.known import STANDINGS, Known
from gateway.metrics import Metrics
from gateway.observability.trends import Trends, reader
from gateway.resilience.breaker import STATE_VALUE, Breakers
from gateway.routing.pool import BackendPool

STATES = tuple(s.value for s in BackendState)


class Status:
    def __init__(self, pool: BackendPool, breakers: Breakers, canary: Canary,
                 supervisors: Mapping[str, Supervisor], metrics: Metrics,
                 own: Callable[[], Mapping[str, Any]], trends: Trends | None = None,
                 replica: Callable[[], Mapping[str, Any]] | None = None,
                 kv: Known | None = None) -> None:
        """``own``: this process's sessions pinned per backend (``pins``) and its recent
        degraded replies (``degraded``). ``replica``: in a serving worker, what only the
        whole replica tells (requests in flight and sessions pinned per backend, summed over
        the workers, and every worker's recent degraded replies), so that every worker's
        status page shows the same; else this process's own are the replica's."""
        self._pool = pool
        self._replica = replica
        self._breakers = breakers
        self._canary = canary
        self._own = own
        self._kv = kv  # routing.policy = "kv": the backends' KV event feeds
        self._supervisors = supervisors
        self._m = metrics
        self.trends = trends or Trends(reader(metrics))

    def refresh(self) -> None:
        """Gauges that mirror state (cheap; at every scrape and once a second)."""
        m = self._m
        for b in self._pool.backends:
            m.in_flight.labels(b.name).set(b.in_flight)
            breaker = self._breakers.by_name.get(b.name)
            if breaker is not None:
                m.breaker_state.labels(b.name).set(STATE_VALUE[breaker.state])
            for state in STATES:
                m.backend_state.labels(b.name, state).set(1 if b.state.value == state else 0)
            self.loaded(b)  # a worker's load comes with the snapshot, not from a scrape
        if self._kv is not None:
            self._feeds(self._kv)

    def _feeds(self, kv: Known) -> None:
        m = self._m
        for name, row in self._kv_rows(kv).items():
            for standing in STANDINGS:
                m.kv_standing.labels(name, standing).set(row["standing"] == standing)
            rate = row["prefill_rate"]
            m.kv_prefill_rate.labels(name).set(rate if rate is not None else -1)
            m.kv_prefill_pending.labels(name).set(row["prefill_pending"])
            if "blocks" in row:
                m.kv_blocks.labels(name).set(row["blocks"])
                age = row["event_age_s"]
                m.kv_event_age.labels(name).set(age if age is not None else -1)
        for name, heard in kv.heard().items():
            for what in ("batches", "bad", "gaps", "replayed", "resets"):
                m.kv_feed.labels(name, what).set(getattr(heard.counts, what))
        for result, n in kv.lookups.items():
            m.kv_lookups.labels(result).set(n)

    def _kv_rows(self, kv: Known) -> dict[str, dict[str, Any]]:
        """What the kv policy knows of each backend's cache, for the metrics and the page."""
        now, rows, events = time.monotonic(), {}, kv.heard()
        for b in self._pool.backends:
            rate = kv.prefill.rates.get(b.name)
            row: dict[str, Any] = {
                "standing": kv.standing(b.name),
                "prefill_rate": round(rate) if rate is not None else None,
                "prefill_pending": kv.prefill.ahead(b.name)}
            heard = events.get(b.name)
            if heard is not None:
                last = heard.counts.last_event
                row.update(blocks=kv.index.blocks(b.name), gaps=heard.counts.gaps,
                           resets=heard.counts.resets, lag_s=round(heard.lag, 3),
                           event_age_s=round(now - last, 1) if last is not None else None)
            rows[b.name] = row
        return rows

    def loaded(self, backend: Backend) -> None:
        """A backend's scraped load and GPU readings, re-exported."""
        load, m, name = backend.load, self._m, backend.name
        if load is None:
            return
        m.vllm_running.labels(name).set(load.running)
        m.vllm_waiting.labels(name).set(load.waiting)
        if load.kv_usage is not None:
            m.vllm_kv_usage.labels(name).set(load.kv_usage)
        if load.prefix_hit_ratio is not None:
            m.vllm_prefix_hits.labels(name).set(load.prefix_hit_ratio)
        for gpu in load.gpus:
            m.gpu_memory_used.labels(name, str(gpu.index)).set(gpu.memory_used)
            m.gpu_memory_total.labels(name, str(gpu.index)).set(gpu.memory_total)
            m.gpu_temperature.labels(name, str(gpu.index)).set(gpu.temperature)

    def _adapters(self, backend: Backend) -> dict[str, Any] | None:
        """A LoRA instance's adapters (issue 41): those it lists, those its batches run
        now and its slots for them (vLLM's ``lora_requests_info``)."""
        if not backend.spec.serves_lora:
            return None
        load, declared = backend.load, self._pool.adapters.specs
        return {"loaded": sorted(m for m in backend.models if m in declared),
                "running": list(load.loras_running) if load else [],
                "slots": load.max_loras if load else None}

    def data(self) -> dict[str, Any]:
        now = time.monotonic()
        counts = self._replica() if self._replica is not None else {}
        own = self._own()
        pins = counts.get("pins", own["pins"])
        in_flight = counts.get("in_flight", {})
        backends = []
        for b in self._pool.backends:
            load = b.load
            backends.append({
                "name": b.name, "group": b.spec.group, "url": b.spec.shown_url,
                "state": b.state.value, "sleep_level": b.sleep_level,
                "spawned": b.managed, "pid": b.pid, "restarts": b.restarts,
                "uptime_s": round(now - b.started_at, 1) if b.started_at is not None else None,
                "in_flight": in_flight.get(b.name, b.in_flight), "queue": b.queue,
                "pins": pins.get(b.name, 0),
                "running": load.running if load else None,
                "waiting": load.waiting if load else None,
                "kv_usage": load.kv_usage if load else None,
                "prefix_hit_ratio": load.prefix_hit_ratio if load else None,
                "gpus": [{"index": g.index, "memory_used": g.memory_used,
                          "memory_total": g.memory_total, "temperature": g.temperature}
                         for g in load.gpus] if load else [],
                "breaker": self._breakers.status(b.name), "last_probe": b.last_probe,
                "models": sorted(b.models), "adapters": self._adapters(b)})
        if self._kv is not None:
            kv = self._kv_rows(self._kv)
            for row in backends:
                row["kv"] = kv.get(row["name"])
        return {"backends": backends, "canary": self._canary.status(),
                "degraded": counts.get("degraded", own["degraded"]),
                "trends": self.trends.data(),
                "time": time.time()}
