"""Canary arms with a real valkey: a session's arm and its pin read in one round trip."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.canary.arms import Arms
from gateway.canary.rollout import Canary
from gateway.config import BreakerSection, CanarySection, RoutingSection
from gateway.config.tenancy import LimitsSection
from gateway.metrics import Metrics
from gateway.request.lookup import Lookup
from gateway.resilience.breaker import Breakers
from gateway.routing.pins import PinStore
from gateway.routing.policies import make_policy
from gateway.routing.pool import BackendPool
from gateway.routing.responses import ResponsePins
from gateway.routing.router import Router
from gateway.state.link import RedisLink
from gateway.tenants.gate import TenantGate
from gateway.tenants.keyring import Keyring
from gateway.tenants.ledger import Ledger
from gateway.tenants.limits import Limits
from tests import factories
from tests.helpers import RedisServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    yield s
    s.stop()


def round_trips(metrics: Metrics) -> float:
    return sum(s.value for s in metrics.redis_latency.collect()[0].samples
               if s.name.endswith("_count"))


def test_a_sessions_arm_and_pin_share_one_round_trip(server: RedisServer) -> None:
    metrics = Metrics()
    pool_backends = [factories.backend("s0", "http://127.0.0.1:1", ready=True, models=["m"]),
                     factories.backend("c0", "http://127.0.0.1:2", ready=True, models=["m"],
                                       group="canary")]

    async def main() -> tuple[float, str | None, str | None, str | None]:
        client = aioredis.from_url(server.url, decode_responses=True)
        link = RedisLink(client, "t:", 1.0, metrics, timeout=2.0)
        breakers = Breakers(BreakerSection(), [b.name for b in pool_backends])
        pool = BackendPool(pool_backends, breakers.allows)
        settings = RoutingSection()
        router = Router(pool, make_policy(settings), PinStore(link, 60), settings, metrics,
                        breakers)
        canary = Canary(CanarySection(enabled=True, weight=50), metrics)
        arms = Arms(pool, canary, PinStore(link, 60, "arm"))
        gate = TenantGate(Limits(link, LimitsSection(), 1, 60, metrics),
                          Ledger(link, Keyring(), 60))
        lookup = Lookup(link, router.store, arms.store, canary,
                        ResponsePins(None, 60, pool), gate)
        record = factories.record(session_key="conversation-1")
        arms.draw(record)
        facts, only = await lookup(record, None, *router.propose(record.request, record.group))
        trips = round_trips(metrics)  # before it is routed: one
        assert only is None and facts.answered and facts.new and facts.arm is None
        arms.settle(record, facts)
        ticket = router.choose(record.request, record.group, facts=facts)
        await link.settled()
        assert ticket is not None
        stored_arm = await client.get("t:arm:m:conversation-1")
        pin = await client.get("t:pin:m:conversation-1")
        await link.aclose()
        return trips, stored_arm, pin, record.group

    trips, stored_arm, pin, group = asyncio.run(main())
    assert trips == 1
    assert stored_arm == group
    assert pin == ("c0" if group == "canary" else "s0")
