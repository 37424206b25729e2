from __future__ import annotations

import pytest

from backends.sim.options import Fault, SimOptions
from backends.sim.prefix import BLOCK, PrefixCache


def test_prefix_cache_counts_shared_prefixes_in_blocks() -> None:
    cache = PrefixCache()
    history = b"s" * (BLOCK * 4)
    assert cache.observe(history) == 0
    assert cache.observe(history + b"t" * BLOCK) == BLOCK * 4
    assert cache.observe(b"x" + history) == 0  # a prefix must match from the start
    assert cache.queries == 3 * BLOCK * 4 + BLOCK + 1
    assert cache.hits == BLOCK * 4


def test_x_sim_header_overrides() -> None:
    opts = SimOptions().override("fault=crash; after=3, ttft=0.5")
    assert (opts.fault, opts.after, opts.ttft) == (Fault.CRASH, 3, 0.5)
    with pytest.raises(ValueError):
        SimOptions().override("bogus=1")


def test_per_model_options() -> None:
    name, overrides = SimOptions.parse_model("slow-model:itl=0.25,tokens=4")
    opts = SimOptions(models=("sim-model", name), model_overrides=((name, overrides),))
    assert opts.for_model("slow-model").itl == 0.25
    assert opts.for_model("slow-model").tokens == 4
    assert opts.for_model("sim-model").itl == 0.0
    with pytest.raises(ValueError):
        SimOptions.parse_model("m:nope=1")
