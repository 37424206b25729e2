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
    assert policy.choose(backends, asked) is backends[2]
    assert cached.rule == "cached"
    backends[2].capacity = 3  # at the capacity the gateway holds it to
    assert policy.choose(backends, asked) is backends[1]  # the next longest prefix
    assert cached.rule == "saturated"
    backends[1].load = LoadReport(running=256, waiting=3)  # vLLM queues what it can't batch
    assert policy.choose(backends, asked) is backends[0]  # the warm ones are full: least
    unknown = dataclasses.replace(request(), cached=None)
    assert policy.choose(backends, unknown) is backends[0]
    cold = Cached(600)
    assert policy.choose(backends, dataclasses.replace(request(), cached=cold)) is backends[0]
    assert cold.rule == "least_loaded"


def test_kv_affinity_yields_when_the_warm_backends_prefill_wait_is_longer() -> None:
    backends = pool(2)
    policy = KvAware()
    cached = Cached(2_000)
    cached.update({"b0": 1_800})
    # b0 has 200 tokens of the prompt to prefill, b1 all 2,000; at 10,000 tokens/s each:
    cached.waits.update({"b0": (1_000 + 200) / 10_000, "b1": 2_000 / 10_000})
    asked = dataclasses.replace(request(), cached=cached)
    assert policy.choose(backends, asked) is backends[0]  # 0.12 s against 0.2 s
    assert cached.rule == "cached"
    cached.waits["b0"] = (3_000 + 200) / 10_000  # 3,000 tokens ahead of it there now
    assert policy.choose(backends, asked) is backends[1]  # 0.32 s against 0.2 s
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


def test_kv_spreads_prompts_of_which_only_a_short_preamble_is_cached() -> None:
    """A shared system prompt's first block is all that is cached of a new document: the
    document goes where least_loaded sends it, not onto the preamble's instance."""
    backends = pool(2)
    policy = KvAware()
    names = []
    for _ in range(4):
        cached = Cached(900)
        cached.update({"b0": 128})  # a seventh of the prompt, on one backend only
        names.append(policy.choose(backends, dataclasses.replace(request(), cached=cached)).name)
        assert cached.rule == "short_prefix"
    assert sorted(names) == ["b0", "b0", "b1", "b1"]
