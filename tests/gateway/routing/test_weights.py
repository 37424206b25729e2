"""``[[backends]] weight``: every policy shares new sessions and sessionless requests in
proportion to it, measured over 10,000 choices."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.routing.hashing import rendezvous, score
from gateway.routing.policies import LeastLoaded, PrefixAware, RoundRobin
from gateway.types import Policy
from tests.factories import backend, request

N = 10_000


def weighted(*weights: int) -> list:
    return [backend(f"b{i}", f"http://127.0.0.1:{i + 1}", weight=w)
            for i, w in enumerate(weights)]


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded()], ids=["rr", "least"])
def test_idle_backends_share_requests_by_weight_exactly(policy: Policy) -> None:
    backends = weighted(1, 3, 6)
    counts = Counter(policy.choose(backends, request()).name for _ in range(N))
    assert counts == {"b0": 1_000, "b1": 3_000, "b2": 6_000}


def test_smooth_turns_spread_a_heavy_backend_out() -> None:
    backends, policy = weighted(1, 3), RoundRobin()
    picks = "".join(policy.choose(backends, request()).name[1] for _ in range(8))
    assert picks.count("0") == 2 and "00" not in picks  # not in runs


def test_least_loaded_divides_the_load_by_the_weight() -> None:
    light, heavy = weighted(1, 2)
    heavy.in_flight = 1  # 1 / 2 = 0.5 < 1 / 1
    light.in_flight = 1
    assert LeastLoaded().choose([light, heavy], request()) is heavy
    heavy.in_flight = 2  # 2 / 2 = 1 > 0 / 1
    light.in_flight = 0
    assert LeastLoaded().choose([light, heavy], request()) is light


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded()], ids=["rr", "least"])
def test_weight_zero_takes_nothing_while_another_can(policy: Policy) -> None:
    backends = weighted(0, 1, 1)
    assert {policy.choose(backends, request()).name for _ in range(100)} == {"b1", "b2"}
    zeros = weighted(0, 0)
    assert Counter(policy.choose(zeros, request()).name for _ in range(100)) == {
        "b0": 50, "b1": 50}


def test_hashing_draws_keys_by_weight_and_keeps_the_plain_order_for_equal_weights() -> None:
    backends = weighted(1, 3)
    counts = Counter(rendezvous(f"session-{i}".encode(), backends).name for i in range(N))
    assert abs(counts["b1"] / N - 0.75) < 0.02, counts
    equal = weighted(1, 1, 1)
    for i in range(500):
        key = f"k{i}".encode()
        plain = max(equal, key=lambda b, k=key: score(k, b.name, 1))
        assert rendezvous(key, equal) is plain


def test_prefix_policy_spreads_prefixes_by_weight() -> None:
    backends, policy = weighted(1, 3), PrefixAware(chars=64, load_factor=1.25)
    counts = Counter(policy.choose(backends, request(payload={"prompt": f"p{i}"})).name
                     for i in range(N))
    assert abs(counts["b1"] / N - 0.75) < 0.02, counts
