from __future__ import annotations

import dataclasses

from backends.backend import LoadReport
from gateway.routing.hashing import rendezvous
from gateway.routing.policies import KvAware, PrefixAware, RoundRobin
from gateway.routing.policies.prefix import prompt_head
from gateway.types import Cached, Request
from tests.factories import backends as pool
from tests.factories import request


def chat(system: str, user: str) -> Request:
    return request(payload={"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": user}]})


def test_prompt_head_reads_messages_then_prompt() -> None:
    assert prompt_head(chat("abc", "def").payload, 5) == b"abc\nd"
    assert prompt_head({"prompt": ["xyz", "q"]}, 2) == b"xy"


def test_same_prefix_same_backend_until_it_is_overloaded() -> None:
    backends = pool(4)
    policy = PrefixAware(chars=64, load_factor=1.25)
    system = "You are a helpful assistant. " * 4
    picks = {policy.choose(backends, chat(system, f"question {i}")) for i in range(10)}
    assert len(picks) == 1
    (home,) = picks
    home.in_flight = 10  # far above the bounded-load cap for 4 backends
    moved = policy.choose(backends, chat(system, "one more"))
    assert moved in backends and moved is not home


def test_different_prefixes_spread() -> None:
    backends = pool(4)
    policy = PrefixAware(chars=64, load_factor=1.25)
    picks = {policy.choose(backends, chat(f"system prompt number {i}", "q")) for i in range(40)}
    assert len(picks) >= 3


def test_rendezvous_moves_only_the_removed_backends_keys() -> None:
    backends = pool(4)
    keys = [f"session-{i}".encode() for i in range(200)]
    before = {k: rendezvous(k, backends) for k in keys}
    after = {k: rendezvous(k, backends[1:]) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is backends[0] for k in moved)


def test_round_robin_ignores_load() -> None:
    backends = pool(3)
    backends[0].in_flight = 100
    policy = RoundRobin()
    names = [policy.choose(backends, chat("s", "u")).name for _ in range(6)]
    assert sorted(names) == ["b0", "b0", "b1", "b1", "b2", "b2"]


def test_kv_takes_the_longest_cached_prefix_until_its_backend_is_full() -> None:
    backends = pool(3)
    policy = KvAware()
    cached = Cached(600)
    cached.update({"b1": 256, "b2": 512})
    asked = dataclasses.replace(request(), cached=cached)
    backends[2].in_flight = 3  # more than the others: nothing to a batch of hundreds
    backends[2].load = LoadReport(running=256, waiting=8)  # a short queue drains in a step
    assert policy.choose(backends, asked) is backends[2]
    assert cached.rule == "cached"
    backends[2].capacity = 3  # at the capacity the gateway holds it to
    assert policy.choose(backends, asked) is backends[1]  # the next longest prefix
    assert cached.rule == "saturated"
    backends[1].load = LoadReport(running=256, waiting=40)  # 32 more waiting than the least
    assert policy.choose(backends, asked) is backends[0]  # the warm ones are full: least
    unknown = dataclasses.replace(request(), cached=None)
    assert policy.choose(backends, unknown) is backends[0]
    cold = Cached(600)
    assert policy.choose(backends, dataclasses.replace(request(), cached=cold)) is backends[0]
    assert cold.rule == "least_loaded"  # no home: a prompt under two blocks


def test_kv_affinity_yields_only_when_the_move_pays_for_its_copy() -> None:
    """The warm instance keeps the prompt until its wait passes 1.1 x the other's wait plus
    the prompt's own prefill there once more (the copy evicts another prompt)."""
    backends = pool(2)
    policy = KvAware()
    cached = Cached(2_000)
    cached.update({"b0": 1_800})
    # b0 has 200 tokens of the prompt to prefill, b1 all 2,000; at 10,000 tokens/s each:
    cached.waits.update({"b0": (3_000 + 200) / 10_000, "b1": 2_000 / 10_000})
    cached.own.update({"b0": 200 / 10_000, "b1": 2_000 / 10_000})
    asked = dataclasses.replace(request(), cached=cached)
    assert policy.choose(backends, asked) is backends[0]  # 0.32 s against 1.1 x 0.4 s
    assert cached.rule == "cached"
    cached.waits["b0"] = (4_500 + 200) / 10_000
    assert policy.choose(backends, asked) is backends[1]  # 0.47 s against 0.44 s
    assert cached.rule == "prefill"


def test_kv_rotates_among_candidates_that_hold_the_same_prefix() -> None:
    """A prefix every backend holds equally, nothing pending: the requests spread as
    least_loaded's do instead of all going to the first."""
    backends = pool(2)
    policy = KvAware()
    names = []
    for _ in range(4):
        cached = Cached(200)
        cached.update({"b0": 128, "b1": 128})
        names.append(policy.choose(backends, dataclasses.replace(request(), cached=cached)).name)
        assert cached.rule == "cached"
    assert sorted(names) == ["b0", "b0", "b1", "b1"]


def test_kv_places_a_prompt_cached_nowhere_at_its_home_with_bounded_load() -> None:
    """Nothing (or only a short preamble) cached: each prompt goes to its head's rendezvous
    home, the same every time (an evicted prompt comes back where it was), different heads
    spread, and a home far above the average in flight passes it on."""
    backends = pool(4)
    policy = KvAware()

    def place(head: bytes, preamble: int = 0) -> tuple[str, str]:
        cached = Cached(900, home=head)
        if preamble:
            cached.update({"b0": preamble})  # a seventh of the prompt, on one backend only
        chosen = policy.choose(backends, dataclasses.replace(request(), cached=cached))
        return chosen.name, cached.rule

    homes = {place(f"document {i}".encode())[0] for i in range(40)}
    assert len(homes) == 4
    home, rule = place(b"document 7")
    assert rule == "home"
    assert {place(b"document 7")[0] for _ in range(5)} == {home}
    assert place(b"document 7", preamble=128) == (home, "short_prefix")
    busy = next(b for b in backends if b.name == home)
    busy.in_flight = 10  # over 1.25 x the average in flight
    assert place(b"document 7")[0] != home


def test_kv_bounds_a_homes_load_by_every_processs_requests_when_it_knows_them() -> None:
    """With several serving processes, this one's own count says little: one request of
    its own on the home, none elsewhere, passed the cap of 1.25 x the average (a copy of the
    prompt in a second cache). With the other processes' counts (``Cached.others``) beside
    its own, the home keeps the prompt while it holds no more than the others, and passes
    it on when it does."""
    backends = pool(4)
    policy = KvAware()

    def place(others: dict[str, int]) -> str:
        cached = Cached(900, home=b"document 7")
        cached.others.update(others)
        return policy.choose(backends, dataclasses.replace(request(), cached=cached)).name

    home = place({})
    busy = next(b for b in backends if b.name == home)
    busy.in_flight = 2  # this process's own: more than its share of 3
    assert place({}) != home
    even = {b.name: 11 if b is busy else 13 for b in backends}  # 13 each with its own
    assert place(even) == home
    assert place({**even, home: 18}) != home  # 20 with its own: the cap is 19
