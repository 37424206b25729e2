"""Prometheus metrics, in a registry of the app's own (no module-level state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sticky = Counter(
            "gateway_sticky_total", "Session routing outcomes: hit, miss (new pin), repin, "
            "rebalance (moved off an overloaded backend), fallback (Redis unavailable)",
            ["result"], registry=r)
        self.redis_errors = Counter("gateway_redis_errors_total", "Failed Redis calls",
                                    registry=r)
        self.redis_up = Gauge("gateway_redis_up", "1 while Redis answers", registry=r)
        self.redis_latency = Histogram(
            "gateway_redis_latency_seconds", "Redis round trips",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r)

        self.breaker_state = Gauge(
            "gateway_breaker_state", "Circuit breaker per backend: 0 closed, 1 half-open, 2 open",
            ["backend"], registry=r)
        self.breaker_transitions = Counter(
            "gateway_breaker_transitions_total", "Circuit breaker state changes",
            ["backend", "from_state", "to_state"], registry=r)
        self.retries = Counter(
            "gateway_retries_total", "Attempts retried on another backend before the first byte",
            ["reason"], registry=r)
        self.retry_budget_exhausted = Counter(
            "gateway_retry_budget_exhausted_total", "Retries refused because the budget was spent",
            registry=r)
        self.degraded = Counter(
            "gateway_degraded_replies_total", "Requests no backend could serve, by what they got: "
            "cache (an earlier reply), static (the configured message), unavailable (503)",
            ["kind"], registry=r)
        self.stream_failures = Counter(
            "gateway_stream_failures_total", "Replies that failed after their headers went out: "
            "dropped (connection lost), stalled (idle timeout), inband (error event in a 200)",
            ["cause"], registry=r)

        self.group_requests = Counter(
            "gateway_group_requests_total", "Upstream attempts per backend group, by outcome: "
            "ok, error (5xx, connect, timeout, broken stream), client_error (4xx)",
            ["group", "outcome"], registry=r)
        self.group_ttft = Histogram(
            "gateway_group_ttft_seconds", "Time to the first byte relayed, per backend group",
            ["group"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                30.0, 60.0), registry=r)
        self.canary_weight = Gauge("gateway_canary_weight", "Traffic percentage per group",
                                   ["group"], registry=r)
        self.canary_step = Gauge("gateway_canary_step", "Rollout step index (-1: set by hand)",
                                 registry=r)
        self.canary_decisions = Counter(
            "gateway_canary_decisions_total", "Rollout analysis verdicts: advance, rollback",
            ["decision"], registry=r)
        self.shadow_requests = Counter(
            "gateway_shadow_requests_total", "Requests mirrored to the canary, by outcome",
            ["outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
