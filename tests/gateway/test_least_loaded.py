from __future__ import annotations

from backends.backend import Backend
from backends.spec import BackendSpec
from gateway.config import RoutingSection
from gateway.routing.policies import make_policy
from gateway.types import RequestContext

CTX = RequestContext("r", "/v1/completions", "m", False, None, b"{}", [])


def backends(*loads: int) -> list[Backend]:
    out = []
    for i, load in enumerate(loads):
        b = Backend(BackendSpec(name=f"b{i}", url=f"http://127.0.0.1:{i + 1}"))
        b.in_flight = load
        out.append(b)
    return out


def test_fewest_in_flight_wins() -> None:
    pool = backends(3, 1, 2)
    assert make_policy(RoutingSection(policy="least_loaded")).choose(pool, CTX) is pool[1]


def test_ties_rotate() -> None:
    pool = backends(0, 5, 0)
    policy = make_policy(RoutingSection(policy="least_loaded"))
    picks = [policy.choose(pool, CTX) for _ in range(4)]
    assert {p.name for p in picks if p} == {"b0", "b2"}
    assert picks[0] is not picks[1]


def test_no_candidates() -> None:
    assert make_policy(RoutingSection(policy="least_loaded")).choose([], CTX) is None
