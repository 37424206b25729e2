from __future__ import annotations

from backends.backend import Backend
from gateway.config import RoutingSection
from gateway.routing.policies import make_policy
from tests.factories import backend, request

CTX = request(path="/v1/completions", body=b"{}")


def backends(*loads: int) -> list[Backend]:
    return [backend(f"b{i}", f"http://127.0.0.1:{i + 1}", in_flight=load)
            for i, load in enumerate(loads)]


def test_fewest_in_flight_wins() -> None:
    pool = backends(3, 1, 2)
    assert make_policy(RoutingSection(policy="least_loaded")).choose(pool, CTX) is pool[1]


def test_ties_rotate() -> None:
    pool = backends(0, 5, 0)
    policy = make_policy(RoutingSection(policy="least_loaded"))
    picks = [policy.choose(pool, CTX) for _ in range(4)]
    assert {p.name for p in picks} == {"b0", "b2"}
    assert picks[0] is not picks[1]
