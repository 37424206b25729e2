"""The gateway's Prometheus metrics: one documented set, in a registry of the app's own.

With several worker processes, ``serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` before the
workers start; every process then writes its values there and any worker's ``/metrics``
adds them all up (prometheus-client's multiprocess mode). Gauges say how: ``livesum``
for in-flight counts, ``livemin`` for Redis health, ``livemax`` for the rest (states,
weights and readings every process sees alike).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
GAPS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class Children:
    """Label children looked up once: prometheus_client's ``labels()`` validates and takes a
    lock on every call, a few µs on each request. Bounded as the labels themselves are."""

    __slots__ = ("_found",)

    def __init__(self) -> None:
        self._found: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._found.get(key)
        if child is None:
            child = self._found[key] = metric.labels(*labels)
        return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.lifecycle: Callable[[], LifecycleCounts] | None = None
        r = self.registry

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels, registry=r)

        def gauge(name: str, text: str, labels: tuple[str, ...] = (),
                  mode: str = "livemax") -> Gauge:
            return Gauge(name, text, labels, registry=r, multiprocess_mode=mode)  # type: ignore[arg-type]

        def histogram(name: str, text: str, labels: tuple[str, ...],
                      buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, labels, buckets=buckets, registry=r)

        # Requests, as clients saw them.
        self.requests = counter(
            "gateway_requests_total", "Client requests by the backend and group that answered "
            "(none: no backend), model (as clients name it) and HTTP status",
            ("backend", "group", "model", "status"))
        self.ttft = histogram("gateway_ttft_seconds", "Time from the request to its first byte "
                              "relayed, by the backend and group that answered",
                              ("backend", "group"), LATENCY)
        self.inter_token = histogram(
            "gateway_inter_token_seconds", "Mean gap between the chunks of one stream",
            ("group",), GAPS)
        self.duration = histogram("gateway_request_duration_seconds",
                                  "Time from the request to its last byte", ("group",), LATENCY)
        self.auth_failures = counter(
            "gateway_auth_failures_total", "Credentials refused, by where (api: an API key on "
            "/v1, admin: the admin key) and why (missing, invalid)", ("route", "reason"))
        self.connections_refused = counter(
            "gateway_connections_refused_total", "Client connections closed at once because "
            "the process held gateway.max_connections")
        self.workers_replaced = gauge(
            "gateway_workers_replaced", "Serving workers the control process replaced since "
            "it started, by why (hung: stopped reporting, killed; exited)", ("reason",), "max")
        self.connections_evicted = counter(
            "gateway_connections_evicted_total", "Idle client connections (nothing sent yet, "
            "or kept alive between requests) closed to make room for a new one at "
            "gateway.max_connections")
        self.in_flight = gauge("gateway_in_flight", "Requests in flight per backend",
                               ("backend",), "livesum")
        self.backend_state = gauge(
            "gateway_backend_state", "1 for the state each backend is in (starting, ready, "
            "unhealthy, draining, stopped, failed, asleep, waking, verifying)",
            ("backend", "state"))
        # Attempts per group (the canary analysis counts the same things).
        self.group_requests = counter(
            "gateway_group_requests_total", "Upstream attempts per backend group, by outcome: "
            "ok, error (5xx, connect, timeout, broken stream), client_error (4xx), other "
            "(busy, client gone)", ("group", "outcome"))
        self.group_ttft = histogram("gateway_group_ttft_seconds",
                                    "Time to the first byte of each successful attempt",
                                    ("group",), LATENCY)
        # Resilience.
        self.breaker_state = gauge(
            "gateway_breaker_state", "Circuit breaker per backend: 0 closed, 1 half-open, 2 open",
            ("backend",))
        self.breaker_transitions = counter(
            "gateway_breaker_transitions_total", "Circuit breaker state changes",
            ("backend", "from_state", "to_state"))
        self.retries = counter("gateway_retries_total", "Attempts retried on another backend "
                               "before the first byte, by what failed", ("reason",))
        self.retry_budget_exhausted = counter(
            "gateway_retry_budget_exhausted_total", "Retries refused because the budget was spent")
        self.degraded = counter(
            "gateway_degraded_replies_total", "Requests no backend could serve, by what they got: "
            "cache (an earlier reply), fallback (the model's fallback model), static (the "
            "configured message), unavailable (503)",
            ("kind",))
        self.stream_failures = counter(
            "gateway_stream_failures_total", "Replies that failed after their headers went out: "
            "dropped (connection lost), stalled (idle timeout), inband (error event in a 200)",
            ("cause",))
        self.stream_continuations = counter(
            "gateway_stream_continuations_total", "Broken streams and what became of them: "
            "completed (another backend finished the answer), failed (the continuation did "
            "not), declined (not continuable: see README)", ("outcome",))
        # Tenants: the key's name (bounded to the configured names), never the key.
        self.tokens = counter(
            "gateway_tokens_total", "Tokens vLLM reported (usage), by key name, model and kind "
            "(prompt, completion; a batch line's: batch_prompt, batch_completion)",
            ("key", "model", "kind"))
        # LoRA adapters (issue 41): adapter names are the configured ones only.
        self.adapter_loads = counter(
            "gateway_adapter_loads_total", "LoRA adapter loads the gateway asked of an "
            "instance, by result: loaded, present (another worker had loaded it), refused (vLLM "
            "answered an error), failed (no answer)",
            ("backend", "adapter", "result"))
        self.adapter_unloads = counter(
            "gateway_adapter_unloads_total", "LoRA adapters a reload removed, unloaded "
            "from the instances that had them, by result: unloaded, failed",
            ("backend", "adapter", "result"))
        self.adapter_load_time = histogram(
            "gateway_adapter_load_seconds", "Time vLLM took to load a LoRA adapter",
            ("adapter",), (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.kv_blocks = gauge(
            "gateway_kv_blocks", "routing.policy = kv: blocks each backend holds in its KV "
            "cache, as its events say", ("backend",))
        self.kv_feed = gauge(
            "gateway_kv_feed", "Each backend's KV event feed since start: batches applied, bad "
            "(passed over), gaps, replayed (batches a replay filled in), resets (its blocks "
            "dropped: a restart, or a gap no replay filled)", ("backend", "what"))
        self.kv_event_age = gauge(
            "gateway_kv_event_age_seconds", "Seconds since each backend's last KV event batch "
            "(-1: none yet)", ("backend",))
        self.kv_standing = gauge(
            "gateway_kv_standing", "How each backend is routed (1 for its standing): exact "
            "(by its events), estimated (no events), unsynced (not yet in step, or events "
            "lost lately), lagging (its events come late), inexact (its predictions keep "
            "missing); all but exact go by the gateway's own estimate (1 where every "
            "serving process routes it so)", ("backend", "standing"), "livemin")
        self.kv_prefill_rate = gauge(
            "gateway_kv_prefill_rate", "Each backend's measured prefill rate (tokens/s; -1: "
            "not measured yet), from the streams it served", ("backend",))
        self.kv_prefill_pending = gauge(
            "gateway_kv_prefill_pending_tokens", "Prompt tokens sent to each backend and not "
            "yet prefilled, by every serving process (the kv policy's load)", ("backend",))
        self.kv_lookups = gauge(
            "gateway_kv_lookups", "Requests whose prompt was tokenized for the kv policy "
            "(asked), and those routed without a prediction (unknown: another route, a "
            "cache_salt, or no tokens in time)", ("result",), "livesum")
        self.kv_predicted = counter(
            "gateway_kv_predicted_tokens_total", "routing.policy = kv: prompt tokens the "
            "chosen backend was predicted to hold in its KV cache", ("backend",))
        self.kv_cached = counter(
            "gateway_kv_cached_tokens_total", "Prompt tokens vLLM said it found cached "
            "(usage.prompt_tokens_details.cached_tokens), for predicted requests", ("backend",))
        self.kv_predictions = counter(
            "gateway_kv_predictions_total", "Predictions against vLLM's cached tokens: exact, "
            "over (predicted more: evicted), under (predicted less)", ("backend", "result"))
        self.limit_rejections = counter(
            "gateway_limit_rejections_total", "Requests refused by a key's limit (rpm, tpm, "
            "concurrency, model) or because limits could not be checked (redis)",
            ("key", "limit"))
        self.queue_depth = gauge("gateway_queue_depth", "Requests held in the gateway's queue "
                                 "by priority band (summed over workers)", ("band",), "livesum")
        self.batch_lines = counter(
            "gateway_batch_lines_total", "Batch lines answered, by result (completed: a 2xx; "
            "failed: any other answer, in the error file)", ("result",))
        self.batches_ended = counter(
            "gateway_batches_total", "Batches that ended, by status (completed, expired, "
            "cancelled, failed)", ("status",))
        self.batch_queued = gauge("gateway_batch_lines_queued", "Lines of running batches not "
                                  "yet sent", (), "livesum")
        self.batch_in_flight = gauge(
            "gateway_batch_lines_in_flight", "Batch lines in flight: the capacity the batch "
            "band holds", (), "livesum")
        self.queue_wait = histogram("gateway_queue_wait_seconds", "Time each request waited "
                                    "in the gateway's queue", (), LATENCY)
        self.shed = counter("gateway_shed_total", "Requests let go from the gateway's queue "
                            "with a 503: full, timeout", ("reason",))
        # Sessions and Redis.
        self.sticky = counter(
            "gateway_sticky_total", "Session routing outcomes: hit, miss (new pin), repin, "
            "rebalance (moved off an overloaded backend), fallback (Redis unavailable), sole "
            "(the only backend that could take it: pinned there without a lookup)",
            ("result",))
        self.redis_errors = counter("gateway_redis_errors_total", "Failed Redis calls")
        self.reply_cache_dropped = counter(
            "gateway_reply_cache_dropped_total",
            "Replies not kept for degraded answers because the write queue was full")
        self.redis_up = gauge("gateway_redis_up", "1 while Redis answers", (), "livemin")
        self.redis_latency = histogram(
            "gateway_redis_latency_seconds", "Redis round trips", (),
            (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        # Canary.
        self.canary_weight = gauge("gateway_canary_weight", "Traffic percentage per group",
                                   ("group",))
        self.canary_step = gauge("gateway_canary_step", "Rollout step index (-1: set by hand)")
        self.canary_decisions = counter(
            "gateway_canary_decisions_total", "Rollout analysis verdicts: advance, rollback",
            ("decision",))
        self.shadow_requests = counter(
            "gateway_shadow_requests_total", "Requests mirrored to the canary, by outcome",
            ("outcome",))
        # What each vLLM backend reports about itself (scraped), and its GPUs (NVML).
        self.vllm_running = gauge("gateway_backend_requests_running",
                                  "vllm:num_requests_running, scraped", ("backend",))
        self.vllm_waiting = gauge("gateway_backend_requests_waiting",
                                  "vllm:num_requests_waiting, scraped", ("backend",))
        self.vllm_kv_usage = gauge("gateway_backend_kv_cache_usage_ratio",
                                   "vllm:kv_cache_usage_perc (0-1), scraped", ("backend",))
        self.vllm_prefix_hits = gauge(
            "gateway_backend_prefix_cache_hit_ratio",
            "Prefix-cache hits / queries since the previous scrape", ("backend",))
        self.gpu_memory_used = gauge("gateway_backend_gpu_memory_used_bytes",
                                     "GPU memory in use on a spawned backend's GPUs (NVML)",
                                     ("backend", "gpu"))
        self.gpu_memory_total = gauge("gateway_backend_gpu_memory_total_bytes",
                                      "GPU memory of a spawned backend's GPUs (NVML)",
                                      ("backend", "gpu"))
        self.gpu_temperature = gauge("gateway_backend_gpu_temperature_celsius",
                                     "GPU temperature of a spawned backend's GPUs (NVML)",
                                     ("backend", "gpu"))

    def render(self) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            if self.lifecycle is not None:  # the control process's, relayed to this worker
                registry.register(Lifecycle(self.lifecycle))
            return generate_latest(registry)
        return generate_latest(self.registry)

    def count_lifecycle(self, source: Callable[[], LifecycleCounts]) -> None:
        """Export the control plane's counts of each backend's changes of state (issue 39):
        ``source`` gives them as ``gateway.control.demand.Demand.counts`` does, read in this
        process (one process alone) or relayed by the control process."""
        self.lifecycle = source
        if not self.multiprocess:
            self.registry.register(Lifecycle(source))


# {"transitions": [[backend, from, to, n]], "seconds": [[backend, state, n, sum]],
#  "checks": [[backend, result, n]]}
LifecycleCounts = dict[str, list[list[Any]]]


class Lifecycle:
    """The control plane's counts, as metric families at each scrape."""

    def __init__(self, source: Callable[[], LifecycleCounts]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        counts = self._source()
        moves = CounterMetricFamily(
            "gateway_backend_transitions", "Changes of a backend's state made or seen by the "
            "control plane, from one state to another", labels=("backend", "from", "to"))
        for backend, old, new, n in counts.get("transitions", ()):
            moves.add_metric((backend, old, new), n)
        spent = SummaryMetricFamily(
            "gateway_backend_state_seconds", "Time a backend spent in a state, observed when it "
            "left it (waking: the wake; starting: the start...)", labels=("backend", "state"))
        for backend, state, n, total in counts.get("seconds", ()):
            spent.add_metric((backend, state), n, total)
        checks = CounterMetricFamily(
            "gateway_backend_wake_checks", "Wakes of a sleeping instance, by result: ok (its "
            "answer the same as before its first sleep), unchecked (no answer was recorded), "
            "wrong_answer, failed (the wake itself, or vLLM not saying whether it sleeps): "
            "the last two restart it cold", labels=("backend", "result"))
        for backend, result, n in counts.get("checks", ()):
            checks.add_metric((backend, result), n)
        yield from (moves, spent, checks)
