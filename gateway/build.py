"""The composition root: every part of a gateway, built whole from its config.

Nothing here does I/O or needs a running loop: the Redis link is built before its server is
up and answers "unavailable" until the lifespan opens it; the probes' HTTP session opens on
first use. The lifespan (``gateway.lifespan``) only starts and stops what is built here,
and the app (``gateway.app``) only routes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from backends.backend import Backend
from backends.discovery import Discovery
from backends.health import HealthChecker, HttpProbe
from backends.spec import BackendSpec
from backends.supervisor import Supervisor
from gateway import __version__
from gateway.admin.backends import Admin
from gateway.admin.canary import CanaryAdmin, Reload
from gateway.admin.reload import Reloadable, Reloader, background
from gateway.batch import service as batch_service
from gateway.batch.service import BatchService
from gateway.canary.arms import Arms
from gateway.canary.rollout import Canary
from gateway.canary.shadow import Shadow
from gateway.canary.sync import CanarySync
from gateway.canary.tally import Tally
from gateway.config import Config
from gateway.control.demand import Demand
from gateway.control.link import ControlLink, ForwardedAdmin
from gateway.control.role import SINGLE, Kind, Role
from gateway.control.server import WorkerTable
from gateway.http.auth import Refusals
from gateway.kv.fanout import Mirror, Publisher
from gateway.kv.feed import Feeds
from gateway.kv.index import Index
from gateway.kv.known import Known
from gateway.metrics import Metrics
from gateway.observability import tracing
from gateway.observability.access_log import RequestLog
from gateway.observability.routes import About, OpsRoutes, started
from gateway.observability.status import Status
from gateway.proxy import Proxy
from gateway.reply.opener import Opener
from gateway.reply.relay import Relay
from gateway.reply.rescue import Rescue
from gateway.reply.resume import Resume
from gateway.request.cache import CacheLookup
from gateway.request.lookup import Lookup
from gateway.request.parse import RequestParser
from gateway.request.plan import Planner
from gateway.request.waking import Waking
from gateway.resilience.breaker import Breakers, MetricsListener
from gateway.resilience.breaker_sync import BreakerSync
from gateway.resilience.degraded import Degraded
from gateway.resilience.replies import ReplyCache
from gateway.routing.adapters import Adapters
from gateway.routing.names import ModelNames
from gateway.routing.pins import PinStore
from gateway.routing.policies import make_policy
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.routing.responses import ResponsePins
from gateway.routing.router import Router
from gateway.state.embedded import EmbeddedValkey
from gateway.state.link import RedisLink
from gateway.tenants.gate import TenantGate
from gateway.tenants.keyring import Keyring
from gateway.tenants.ledger import Ledger
from gateway.tenants.limits import Limits
from gateway.upstream import Upstream, make_upstream


@dataclass(frozen=True)
class SharedState:
    """What a gateway keeps in Redis, and the link (and embedded server) it goes through."""

    link: RedisLink
    embedded: EmbeddedValkey | None
    breaker_sync: BreakerSync | None
    canary_sync: CanarySync


@dataclass(frozen=True)
class Serving:
    """What only a process that serves requests has (the control process has none): the
    proxy, its HTTP client, the router and session pins, the reply cache and degraded
    replies, the gateway's queue."""

    proxy: Proxy
    upstream: Upstream
    router: Router
    replies: ReplyCache
    degraded: Degraded
    queue: WaitQueue
    feeds: Known | None  # routing.policy = "kv": the backends' KV caches, indexed
    waking: Waking  # requests waiting for an instance demand starts


@dataclass(frozen=True)
class Parts:
    metrics: Metrics
    breakers: Breakers
    pool: BackendPool
    canary: Canary
    serving: Serving | None  # None in the control process
    probe: HttpProbe
    checker: HealthChecker
    supervisors: dict[str, Supervisor]
    status: Status
    reloadable: Reloadable
    shared: SharedState | None
    operators: Operators
    role: Role
    workers: WorkerTable | None  # the control process: its serving workers
    link: ControlLink | None  # a serving worker: its line to the control process
    keyring: Keyring  # the API keys and their tenants
    ledger: Ledger  # what each key used
    demand: Demand | None = None  # the control plane: instances started and stopped by demand
    batch: BatchService | None = None  # a serving process with Redis: /v1/files, /v1/batches
    # routing.policy = "kv": what follows the events (one process alone, or the control
    # process, which publishes its index), or a worker's copy of its control's index.
    kv: Feeds | Publisher | Mirror | None = None

    @property
    def proxy(self) -> Proxy:
        assert self.serving is not None, "the control process serves no request"
        return self.serving.proxy

    @property
    def router(self) -> Router:
        assert self.serving is not None, "the control process routes no request"
        return self.serving.router


@dataclass(frozen=True)
class Operators:
    """The operators' side: admin verbs, canary verbs, reload, the read-only routes."""

    admin: Admin
    canary: CanaryAdmin
    reloader: Reloader
    ops: OpsRoutes
    reload: Reload  # what SIGHUP does: this process's reload, and in the control its workers'
    refusals: Refusals  # refused credentials, API and admin keys alike


def shared_state(config: Config, metrics: Metrics, breakers: Breakers,
                 canary: Canary, role: Role) -> SharedState:
    settings = config.redis
    embedded = None
    url = settings.url
    if url == "embedded" and role.redis_url is not None:
        url = role.redis_url  # a worker: the control process runs the embedded server
    elif url == "embedded":
        embedded = EmbeddedValkey(settings.embedded_log, settings.data_dir)
        url = embedded.url
    client = aioredis.from_url(
        # The link bounds every call (connecting included) by redis.timeout itself,
        # forgiving loop lag; socket timeouts of redis-py's own would count that lag.
        url, socket_timeout=None, socket_connect_timeout=None,
        retry=Retry(NoBackoff(), 0), decode_responses=True)
    link = RedisLink(client, settings.key_prefix, settings.retry_interval, metrics,
                     timeout=settings.timeout, opened=False)
    share = config.breaker.enabled and config.breaker.share
    breaker_sync = (BreakerSync(link, breakers, config.breaker.reset_timeout,
                                config.breaker.sync_interval) if share else None)
    return SharedState(link, embedded, breaker_sync, CanarySync(link, canary))


def tenants(config: Config, link: RedisLink | None, keyring: Keyring,
            metrics: Metrics) -> tuple[TenantGate, Ledger]:
    """The keys' limits and what each used (both in Redis when it is used)."""
    limits = Limits(link, config.limits, config.gateway.processes,
                    config.upstream.total_timeout, metrics)
    ledger = Ledger(link, keyring, config.accounting.window)
    return TenantGate(limits, ledger), ledger


def _fixed(config: Config) -> list[BackendSpec]:
    """The backends known from the config itself (``discover`` ones are resolved at start,
    by the lifespan, and after)."""
    return [spec for spec in config.backends if spec.discover is None]


def build(config: Config, path: str | None = None, role: Role = SINGLE,
          upstream: Upstream | None = None) -> Parts:
    """Every part, whole, from ``config`` (read from ``path``, which a reload reads again),
    for the process ``role`` says this is (see ``gateway.control``); ``upstream``: the HTTP
    client to use instead of the one the config names (tests pass an in-memory one)."""
    metrics = Metrics()
    keyring = Keyring(config.keys, config.gateway.api_keys)
    breakers = Breakers(config.breaker, [spec.name for spec in _fixed(config)],
                        [MetricsListener(metrics)])
    adapters = Adapters(config.adapters, metrics, config.routing.adapter_affinity)
    pool = BackendPool([Backend(spec) for spec in _fixed(config)], breakers.allows,
                       ModelNames(config.models), adapters)
    canary = Canary(config.canary, metrics)
    shared = shared_state(config, metrics, breakers, canary, role) if config.uses_redis else None
    link = shared.link if shared is not None else None
    gate, ledger = tenants(config, link, keyring, metrics)
    kv = _kv(config, role)
    serving = None if role.kind is Kind.CONTROL else _request_path(  # it serves no request
        config, pool, breakers, canary, gate, len(keyring.tenants), metrics, link, upstream, kv)
    probe = HttpProbe(config.health.timeout)
    checker = HealthChecker(pool.backends, config.health, probe)
    supervisors: dict[str, Supervisor] = {}
    discovery = Discovery()  # a worker's is told its control process's answers instead
    workers = _workers(role, pool, supervisors, discovery)
    settle = workers.settle if workers is not None else None

    def supervise(backend: Backend) -> Supervisor:
        return Supervisor(backend, config.supervisor, probe, settle=settle)

    if role.control is None:  # a worker's backends live in the control process
        supervisors.update({b.name: supervise(b) for b in pool.backends if b.managed})
    control = _control_link(role, pool, metrics, serving)
    status = Status(pool, breakers, canary, supervisors, metrics,
                    own=_own_counts(serving), kv=serving.feeds if serving else None,
                    replica=(lambda: control.replica) if control is not None else None)
    reloadable = Reloadable(pool, breakers, canary, supervisors,
                            supervise if control is None else None,
                            checker if control is None else None, keyring,
                            serving.queue if serving is not None else None)
    demand = _demand(role, pool, supervisors, workers, serving, metrics)
    operators = _operators(config, path, pool, breakers, canary, status, metrics, reloadable,
                           shared, workers, control, discovery, demand)
    batch = batch_service.make(
        config.batch, config.redis.data_dir, config.gateway.body_timeout, link, serving.proxy,
        pool, serving.queue, keyring, metrics) if serving is not None else None
    if batch is not None:
        operators.ops.batches = batch.api.running
    return Parts(metrics, breakers, pool, canary, serving, probe,
                 checker, supervisors, status, reloadable, shared, operators, role, workers,
                 control, keyring, ledger, demand, batch, kv)


def _kv(config: Config, role: Role) -> Feeds | Publisher | Mirror | None:
    """routing.policy = "kv": one process alone follows the backends' events; with
    workers, the control process does and publishes its index, which each worker copies
    (``gateway.kv.fanout``)."""
    if config.routing.policy != "kv":
        return None
    processes = config.gateway.processes
    if role.kind is Kind.WORKER and role.kv is not None:
        return Mirror(Index(), role.kv, processes, role.slot)
    feeds = Feeds(Index(), processes=processes)
    return Publisher(feeds, processes=processes) if role.kind is Kind.CONTROL else feeds


def _demand(role: Role, pool: BackendPool, supervisors: dict[str, Supervisor],
            workers: WorkerTable | None, serving: Serving | None,
            metrics: Metrics) -> Demand | None:
    """The control plane's starts and stops by demand, told what is used and wanted by its
    workers' reports, or (one process alone) by its own request path."""
    if role.control is not None:
        return None  # a worker shows the control process's counts, from its link
    if workers is not None:
        demand = Demand(pool, supervisors, workers.uses, workers.wanted)
        workers.lifecycle = demand.counts  # relayed to the workers, whose /metrics show it
        return demand
    waking = serving.waking if serving is not None else None
    demand = Demand(pool, supervisors, lambda: {b.name: b.uses for b in pool.backends},
                    lambda: set(waking.wanted()) if waking is not None else set())
    metrics.count_lifecycle(demand.counts)
    return demand


def _request_path(config: Config, pool: BackendPool, breakers: Breakers, canary: Canary,
                  gate: TenantGate, tenants: int, metrics: Metrics, link: RedisLink | None,
                  upstream: Upstream | None, kv: Feeds | Publisher | Mirror | None) -> Serving:
    """A serving process's proxy and what only it uses: the request's plan (its one Redis
    round trip and its candidates) and the reply's parts, each built once here."""
    router = _router(config, pool, link, metrics, breakers)
    replies = ReplyCache(config.degraded, link if config.degraded.cache else None,
                         dropped=metrics.reply_cache_dropped)
    degraded = Degraded(config.degraded, replies, metrics)
    queue = WaitQueue(config.queue, metrics, tenants)
    ttl = config.routing.session_ttl
    # Arms are stored whenever Redis is: a reload may turn the canary on.
    arms = Arms(pool, canary, PinStore(link, ttl, "arm") if link is not None else None)
    upstream = upstream or make_upstream(config.upstream)
    responses = ResponsePins(link if config.routing.pin_responses else None, ttl, pool)
    tracer = tracing.make(config.tracing)
    tally = Tally(metrics, canary).attempt
    shadow = Shadow(upstream, router, pool, canary, metrics, config.upstream.total_timeout)
    lookup = Lookup(link, router.store, arms.store, canary, responses, gate, router.made)
    feeds: Known | None = kv.feeds if isinstance(kv, Publisher) else kv
    cache = CacheLookup(feeds, upstream, pool) if feeds is not None else None
    plans = Planner(router, queue, arms, canary, shadow, lookup, pool, config.upstream,
                    metrics, tracer, tally, cache)
    opener = Opener(pool, upstream, responses, tracer)
    relay = Relay(pool, degraded.cache, config.degraded.cache_max_bytes, metrics)
    relay.explain = config.routing.kv_header
    if config.resilience.continue_streams != "off":
        relay.resume = Resume(config.resilience, config.upstream, router, opener, relay,
                              metrics, tally, tracer)
    parse = RequestParser(config, responses, pool, config.injects_usage)
    access = RequestLog(metrics, config.gateway.access_log, tracer)
    proxy = Proxy(config, parse, gate, plans, opener, relay, Rescue(pool, degraded), access)
    return Serving(proxy, upstream, router, replies, degraded, queue, feeds, plans.waking)


def _own_counts(serving: Serving | None) -> Callable[[], dict[str, Any]]:
    """This process's own sessions pinned and recent degraded replies, for its status views
    (the control process has none: its workers' sums come through its table)."""
    if serving is None:
        return lambda: {"pins": {}, "degraded": []}
    router, degraded = serving.router, serving.degraded
    return lambda: {"pins": router.pins_made, "degraded": list(degraded.recent)}


def _router(config: Config, pool: BackendPool, link: RedisLink | None, metrics: Metrics,
            breakers: Breakers) -> Router:
    routing = config.routing
    pins = PinStore(link, routing.session_ttl) if link is not None and routing.sticky else None
    return Router(pool, make_policy(routing), pins, routing, metrics, breakers,
                  make_policy(routing, routing.pin_policy), config.gateway.processes)


def _workers(role: Role, pool: BackendPool, supervisors: dict[str, Supervisor],
             discovery: Discovery) -> WorkerTable | None:
    """The control process's table of its serving workers (None in any other process)."""
    if role.kind is not Kind.CONTROL:
        return None
    return WorkerTable(pool, supervisors, discovered=discovery.found)


def _control_link(role: Role, pool: BackendPool, metrics: Metrics,
                  serving: Serving | None) -> ControlLink | None:
    """A worker's link to its control process: it neither probes nor supervises, but adopts
    the control process's snapshot, and reports the sessions it pinned and the degraded
    replies it gave."""
    if role.control is None or serving is None:
        return None
    router, degraded = serving.router, serving.degraded
    link = ControlLink(role.control, pool, replaced=metrics.workers_replaced,
                       pins=lambda: router.pins_made, recent=lambda: degraded.recent,
                       wanted=serving.waking.wanted)
    metrics.count_lifecycle(lambda: link.lifecycle)
    return link


def _operators(config: Config, path: str | None, pool: BackendPool, breakers: Breakers,
               canary: Canary, status: Status, metrics: Metrics, reloadable: Reloadable,
               shared: SharedState | None, workers: WorkerTable | None,
               link: ControlLink | None, discovery: Discovery,
               demand: Demand | None) -> Operators:
    key = config.gateway.admin_key
    args = (pool, reloadable.supervisors, breakers, key.get_secret_value() if key else None,
            config.supervisor.drain_timeout)
    refusals = Refusals(metrics.auth_failures)
    admin = (ForwardedAdmin(link, *args, refusals=refusals) if link is not None
             else Admin(*args, settle=workers.settle if workers else None,
                        trusted=workers is not None, refusals=refusals, demand=demand))
    reloader = Reloader(reloadable, config, path,
                        Discovery(told=link.discovered) if link is not None else discovery)
    reload: Reload = reloader
    if workers is not None:  # the control process reads the file once for its workers
        async def reload_all(who: str) -> dict[str, Any]:
            summary = await reloader(who)
            workers.publish(reloader.version, reloader.text)
            return summary
        reload = reload_all
    elif link is not None:  # a worker: the control process reloads, and tells it
        reload = link.reload
        link.on_config = lambda text, version: background(
            reloadable, reloader("control", text, version))
    canary_admin = CanaryAdmin(canary, admin.guard, link.reload if link is not None else reload,
                               shared.canary_sync.publish if shared is not None else None)
    gateway_pid = os.getppid() if link is not None else os.getpid()  # a worker: its control
    ops = OpsRoutes(pool, status, metrics, admin.guard, admin.allowed,
                    config.gateway.public_metrics,
                    About(__version__, started(gateway_pid), config.gateway.grafana_url),
                    link.state if link is not None else None)
    return Operators(admin, canary_admin, reloader, ops, reload, refusals)
