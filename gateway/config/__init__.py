"""config.toml, read with tomllib and validated into frozen objects.

Every problem is reported at once as ``dotted.key.path: message``; ``load`` adds where the
key was set (``file:line`` or the ``VGW_...`` variable) and applies the environment's
overrides (gateway.config.source).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    PlainValidator,
    ValidationError,
    field_validator,
)

from backends.health import HealthSettings
from backends.spec import BackendSpec, Secret
from backends.supervisor import SupervisorSettings
from gateway.config.adapters import AdapterSpec, adapter_problems, derive
from gateway.config.batch import BatchSection
from gateway.config.canary import CanarySection as CanarySection
from gateway.config.canary import RolloutSection as RolloutSection
from gateway.config.checks import duplicate_keys, duplicate_names, duplicate_ports, gpu_budgets
from gateway.config.source import Where, apply_env
from gateway.config.tenancy import AccountingSection, KeySpec, LimitsSection, QueueSection
from gateway.config.values import (
    SessionFrom,
    SessionSource,
    check_listen,
    check_redis_url,
    session_source,
    usable_cores,
)

CONFIG_ENV = "VLLM_GATEWAY_CONFIG"  # how `serve` tells its worker processes the config path
CONFIG_TEXT_ENV = "VLLM_GATEWAY_CONFIG_TEXT"  # a file with the text the control process runs
# workers = "auto" stops here: each worker holds its own Redis and upstream connections and
# probes every backend, and a proxy that needs more than 8 cores is rare.
AUTO_WORKERS_CAP = 8


class ConfigError(Exception):
    """The config is invalid; ``problems`` holds one ``dotted.key: message`` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


Listen = Annotated[str, AfterValidator(check_listen)]
SessionKey = Annotated[SessionSource, PlainValidator(session_source)]
RedisUrl = Annotated[str, AfterValidator(check_redis_url)]



class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GatewaySection(Section):
    listen: Listen = "127.0.0.1:8080"
    api_keys: tuple[Secret, ...] = ()
    admin_key: Secret | None = None
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Request bodies held by one process at any moment (each kept until its request ends).
    max_buffered_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    # uvicorn alone lets a client trickle its body forever.
    body_timeout: float = Field(default=30.0, gt=0)
    # ... and its request line and headers, of any size (gateway.http.server).
    header_timeout: float = Field(default=10.0, gt=0, description="seconds to send the headers")
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, description="431 above")
    max_connections: int = Field(default=0, ge=0, description="per process; 0 = from the "
                                 "descriptor limit")
    # Peers whose X-Forwarded-For is believed (addresses or networks); see http.forwarded.
    trusted_proxies: tuple[IPvAnyNetwork, ...] = ()
    public_metrics: bool = True  # false: /metrics, /dashboard... behind the admin key
    keep_alive_timeout: float = Field(default=75.0, gt=0, description="idle between requests")
    media_urls: Literal["allow", "deny_private"] = "allow"  # see gateway.http.media
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    access_log: bool = Field(default=True, description="one log line per request (info)")
    grafana_url: str | None = None  # the status page links to it when set
    # "auto": one serving process per core (up to AUTO_WORKERS_CAP), all behind one port.
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"

    @property
    def processes(self) -> int:
        """Serving processes: ``workers``, or for "auto" the usable cores up to the cap."""
        if self.workers != "auto":
            return self.workers
        return max(1, min(usable_cores(), AUTO_WORKERS_CAP))

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class UpstreamSection(Section):
    client: Literal["httptools", "aiohttp", "httpx"] = "httptools"
    max_connections: int = Field(default=10_000, ge=1)
    max_connections_per_backend: int = Field(default=0, ge=0, description="0 = no limit")
    connect_timeout: float = Field(default=5.0, gt=0)
    # A long prompt can prefill for minutes before the first byte comes back.
    first_byte_timeout: float = Field(default=900.0, gt=0)
    idle_timeout: float = Field(default=300.0, gt=0)
    total_timeout: float = Field(default=3600.0, gt=0)
    # Attempts per request on different backends, before any byte reached the client:
    # after a refused connection, or a 429/5xx answer.
    max_attempts: int = Field(default=3, ge=1, le=10)
    retry_budget_ratio: float = Field(default=0.2, ge=0, le=1)
    retry_budget_floor: int = Field(default=3, ge=0)
    retry_backoff: float = Field(default=0.025, ge=0, description="first retry's max delay")


class RedisSection(Section):
    url: RedisUrl = "embedded"
    key_prefix: str = "vgw:"
    # Every Redis call is bounded by this: it is the most Redis can add to a request.
    timeout: float = Field(default=0.1, gt=0, le=10)
    retry_interval: float = Field(default=1.0, gt=0, description="probe again after an error")
    embedded_log: str = "logs/valkey.log"
    # The embedded server's append-only file (fsynced every second): pins outlive a restart.
    # Relative to the working directory; one gateway per dir (it is locked).
    data_dir: str = Field(default="data/valkey", min_length=1)

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("must not contain a NUL character")
        if not value.strip():
            raise ValueError("must name a directory")
        return value


class RoutingSection(Section):
    session_keys: tuple[SessionKey, ...] = (SessionSource(SessionFrom.HEADER, "x-session-id"),
                                            SessionSource(SessionFrom.BODY, "user"))
    session_key_max_len: int = Field(default=256, ge=1, le=4096)
    # "kv": by what each instance holds in its KV cache (issue 38; docs/KV-ROUTING.md).
    policy: Literal["least_loaded", "round_robin", "prefix", "kv"] = "least_loaded"
    # Where a new session is pinned. Measured on real vLLM (docs/BENCHMARKS.md, GPU): by
    # load clumps sessions that are between turns; turn-taking spreads them evenly.
    pin_policy: Literal["least_loaded", "round_robin", "prefix"] = "round_robin"
    sticky: bool = True
    pin_responses: bool = True  # a stored response's follow-ups go where it is stored
    kv_header: bool = False  # policy "kv": x-gateway-cached-tokens on each reply
    session_ttl: float = Field(default=3600.0, gt=0, description="pin lifetime, refreshed on use")
    prefix_chars: int = Field(default=512, ge=16, description="prompt head to hash")
    bounded_load_factor: float = Field(default=1.25, ge=1.0, description="prefix policy cap")
    # Move a session off its backend when that one carries more than this times the
    # average load; 0 = never.
    session_max_load_factor: float = Field(default=0.0, ge=0.0)
    # LoRA adapters (issue 41): an adapter's requests prefer the instances running it, then
    # those that have it loaded, then those with a free slot; false: any instance of its
    # base, as the policy picks (a baseline for bench/gpu/lora.sh).
    adapter_affinity: bool = True


class BreakerSection(Section):
    """One circuit breaker per backend (pybreaker's state machine)."""

    enabled: bool = True
    failure_threshold: int = Field(default=5, ge=1, description="failures in a row that open it")
    reset_timeout: float = Field(default=10.0, gt=0, description="seconds open before probing")
    half_open_probes: int = Field(default=1, ge=1, description="probes in flight when half-open")
    success_threshold: int = Field(default=1, ge=1, description="probe successes that close it")
    # When breakers (with health) would leave a model no backend: "route" keeps the least-bad
    # healthy backends routable; "degrade" answers from the reply cache / static message.
    panic: Literal["route", "degrade"] = "route"
    # Breaker openings are shared with other gateway processes through Redis.
    share: bool = True
    sync_interval: float = Field(default=0.5, gt=0, le=60)


class DegradedSection(Section):
    """Answers when no backend can: cached earlier replies, else a static message."""

    cache: bool = True
    cache_ttl: float = Field(default=86400.0, gt=0)
    cache_max_bytes: int = Field(default=256 * 1024, ge=256, description="largest reply kept")
    # Only replies to requests at or below this temperature are kept (an absent temperature
    # counts as 1.0, the OpenAI default): a sampled answer is not "the" answer.
    cache_max_temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    local_entries: int = Field(default=256, ge=0, description="in-process copies, for Redis loss")
    static_message: str | None = None
    retry_after: int = Field(default=5, ge=1, description="Retry-After on the final 503")


class ModelRoute(Section):
    """A model name clients use, and what each group serves it as."""

    name: str = Field(min_length=1)
    # group -> the served model name in that group; a group not listed serves it as `name`
    groups: dict[str, str] = Field(default_factory=dict)
    # A smaller model (served by other backends) that answers when none of this one's can.
    fallback: str | None = Field(default=None, min_length=1)


class ResilienceSection(Section):
    """A stream whose backend fails after it began goes on elsewhere (gateway.reply.resume)."""

    continue_streams: Literal["off", "deterministic", "always"] = "deterministic"
    max_continuations: int = Field(default=2, ge=1, le=10, description="per stream")
    # What one stream keeps (by reference) to continue from; a longer one is not continued.
    continue_max_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)


class TracingSection(Section):
    """OpenTelemetry spans (the optional extra ``vllm-gateway[otel]``); off costs nothing."""

    enabled: bool = False
    # OTLP/HTTP traces URL; unset: the exporter's default or OTEL_EXPORTER_OTLP_* variables.
    endpoint: str | None = None
    service_name: str = "vllm-gateway"
    sample_ratio: float = Field(default=1.0, ge=0, le=1, description="of requests without a "
                                "sampled parent")


class Config(Section):
    gateway: GatewaySection = GatewaySection()
    upstream: UpstreamSection = UpstreamSection()
    redis: RedisSection = RedisSection()
    routing: RoutingSection = RoutingSection()
    health: HealthSettings = HealthSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    breaker: BreakerSection = BreakerSection()
    degraded: DegradedSection = DegradedSection()
    resilience: ResilienceSection = ResilienceSection()
    canary: CanarySection = CanarySection()
    models: tuple[ModelRoute, ...] = ()
    keys: tuple[KeySpec, ...] = ()
    limits: LimitsSection = LimitsSection()
    accounting: AccountingSection = AccountingSection()
    queue: QueueSection = QueueSection()
    tracing: TracingSection = TracingSection()
    batch: BatchSection = BatchSection()
    adapters: tuple[AdapterSpec, ...] = ()
    backends: tuple[BackendSpec, ...]

    @property
    def injects_usage(self) -> bool:
        usage = self.accounting.stream_usage
        return usage == "inject" or (usage == "auto" and bool(self.keys))

    @property
    def uses_redis(self) -> bool:
        return self.routing.sticky or (self.breaker.enabled and self.breaker.share) or (
            self.degraded.cache) or self.canary.enabled or any(
            key.rpm or key.tpm or key.max_concurrent for key in self.keys)


def _message(error: Any) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    msg = str(error["msg"])
    return msg.removeprefix("Value error, ")


def group_problems(config: Config) -> list[str]:
    """Groups named by the canary and [[models]] that no backend is in; models twice."""
    groups = {b.group for b in config.backends}
    problems = []
    canary = config.canary
    if canary.enabled:
        for key, name in (("stable", canary.stable), ("group", canary.group)):
            if name not in groups:
                problems.append(f"canary.{key}: no backend is in group {name!r}")
        if canary.stable == canary.group:
            problems.append("canary.group: must differ from canary.stable")
    seen: set[str] = set()
    for i, route in enumerate(config.models):
        if route.name in seen:
            problems.append(f"models.{i}.name: duplicate model {route.name!r}")
        seen.add(route.name)
        problems.extend(f"models.{i}.groups.{g}: no backend is in group {g!r}"
                        for g in route.groups if g not in groups)
        if route.fallback == route.name:
            problems.append(f"models.{i}.fallback: must name another model")
    return problems


def setting_problems(config: Config) -> list[str]:
    """Settings that are valid alone but not together, or not in this installation."""
    problems = []
    if config.upstream.client == "httpx" and config.upstream.max_connections_per_backend:
        problems.append("upstream.max_connections_per_backend: the httpx client has no "
                        "per-backend cap; use client = \"aiohttp\" (the default) or set 0")
    if config.tracing.enabled and not find_spec("opentelemetry.sdk"):
        problems.append("tracing.enabled: needs the otel extra: pip install "
                        "'vllm-gateway[otel]'")
    return problems


def parse(raw: dict[str, Any]) -> Config:
    problems: list[str] = []
    derive(raw)
    config = None
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"]) or "(top level)"
            problems.append(f"{path}: {_message(error)}")
    problems.extend(duplicate_names(raw, "backends"))
    problems.extend(duplicate_names(raw, "keys"))
    if config is not None:
        problems.extend(duplicate_ports(config.backends))
        problems.extend(gpu_budgets(config.backends))
        problems.extend(duplicate_keys(config.keys, config.gateway.api_keys))
        problems.extend(group_problems(config))
        problems.extend(setting_problems(config))
        problems.extend(adapter_problems(config.adapters, config.backends,
                                         {r.name for r in config.models}))
    if raw.get("backends") == []:
        problems.append("backends: at least one backend is required")
    if problems or config is None:
        raise ConfigError(problems)
    return config


def load(path: str | Path, environ: Mapping[str, str] | None = None,
         text: str | None = None) -> Config:
    """The config in ``path`` (or ``text``, read from it already) with the
    ``VGW_SECTION__KEY`` variables of ``environ`` (the process's by default) over it; each
    problem names its file line or variable."""
    path = Path(path)
    try:
        if text is None:
            text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from None
    origins, problems = apply_env(raw, os.environ if environ is None else environ,
                                  frozenset(Config.model_fields))
    where = Where(str(path), text, origins)
    config = None
    try:
        config = parse(raw)
    except ConfigError as exc:
        problems.extend(where(p) for p in exc.problems)
    if problems or config is None:
        raise ConfigError(problems)
    return config
