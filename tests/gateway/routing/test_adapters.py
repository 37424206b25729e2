"""Which instances of an adapter's base its requests go to (issue 41, point 2): those running
it now (vLLM's ``lora_requests_info``), then those that have it loaded, then those with a
free adapter slot, each tier only while one of its instances has room."""

from __future__ import annotations

import asyncio

from backends.backend import LoadReport
from gateway.config.adapters import AdapterSpec
from gateway.routing.adapters import Adapters
from tests.factories import backend
from tests.fakes import FakeUpstream, Reply, always

SPEC = AdapterSpec(name="a1", base="m", path="/srv/a1")


def lora(name: str, running: tuple[str, ...] = (), models: tuple[str, ...] = ("m",),
         waiting: float = 0) -> object:
    return backend(name, f"http://127.0.0.1:{len(name) + 10}", ready=True, models=models,
                   lora=True, load=LoadReport(running=len(running), waiting=waiting,
                                              loras_running=running,
                                              max_loras=2))


def test_an_instance_running_the_adapter_comes_before_one_that_only_has_it() -> None:
    adapters = Adapters([SPEC])
    running, loaded = lora("run", ("a1", "x")), lora("loaded", ("x", "y"), ("m", "a1"))
    free = lora("free")
    assert adapters.prefer([loaded, free, running], "a1") == [running]
    assert adapters.prefer([loaded, free], "a1") == [loaded]
    assert adapters.prefer([free, lora("full", ("x", "y"))], "a1") == [free]


def test_a_tier_whose_instances_all_queue_gives_way_to_the_next() -> None:
    adapters = Adapters([SPEC])
    busy = lora("busy", ("a1",), waiting=3)
    loaded, free = lora("loaded", ("x", "y"), ("m", "a1")), lora("free")
    assert adapters.prefer([busy, loaded, free], "a1") == [loaded]
    everyone = [lora("b1", ("x", "y"), waiting=1), lora("b2", ("x", "y"), waiting=1)]
    assert adapters.prefer(everyone, "a1") == everyone  # no tier has room: the policy picks


def test_without_affinity_every_instance_of_the_base_is_a_candidate() -> None:
    adapters = Adapters([SPEC], affinity=False)
    found = [lora("run", ("a1",)), lora("free")]
    assert adapters.prefer(found, "a1") == found


def test_an_idle_instance_runs_no_adapter_whatever_its_last_step_said() -> None:
    """vLLM sets lora_requests_info at engine steps only: an idle instance's says what its
    last batch ran; it runs nothing now, and all its slots are free."""
    adapters = Adapters([SPEC])
    idle = lora("idle", ("x", "y"))
    idle.load = LoadReport(running=0, loras_running=("a1", "y"), max_loras=2)
    busy_elsewhere = lora("busy", ("x", "y"))
    assert adapters.prefer([busy_elsewhere, idle], "a1") == [idle]  # a free slot, not "running"
    assert adapters.prefer([idle, lora("runs", ("a1",))], "a1")[0].name == "runs"


def test_requests_waiting_for_adapter_slots_everywhere_do_not_switch_affinity_off() -> None:
    """vLLM's waiting queue holds the requests whose adapter found no free batch slot: with
    several adapters in turn, every instance has some. The GPU run that found this spread
    each adapter over 3.5 of 4 instances (docs/gpu/issue41/run1)."""
    adapters = Adapters([SPEC])
    warm = lora("warm", ("a1", "x"), waiting=4)
    others = [lora(f"o{i}", ("x", "y"), waiting=4) for i in range(3)]
    assert adapters.prefer([*others, warm], "a1") == [warm]


def test_an_adapter_instance_far_busier_than_the_idlest_gives_way() -> None:
    adapters = Adapters([SPEC])
    hot = lora("hot", ("a1", "x"), waiting=9)  # 11 queued against 2 elsewhere
    loaded, idle = lora("loaded", ("x", "y"), ("m", "a1")), lora("idle", ("x", "y"))
    assert adapters.prefer([hot, loaded, idle], "a1") == [loaded]
    assert adapters.prefer([hot, idle], "a1") == [hot, idle]  # no tier has room: the policy


def test_a_load_another_worker_made_first_counts_as_present_not_as_a_load() -> None:
    """Each serving process loads an adapter on first use; vLLM answers the second one's
    400 "has already been loaded". On the H100 run those were most of the 75 loads counted."""
    first = Reply(200, [], [b"Success: LoRA adapter 'a1' added successfully."])
    again = Reply.json(400, {"error": {"message": "The lora adapter 'a1' has already been "
                                       "loaded. If you want to load the adapter in place, set "
                                       "'load_inplace' to True.", "type": "BadRequestError",
                                       "code": 400}})
    one, other = lora("one"), lora("other")
    upstream = FakeUpstream({one.url: always(first), other.url: always(again)})  # type: ignore[attr-defined]
    adapters = Adapters([SPEC])
    assert asyncio.run(adapters.ensure(one, "a1", upstream))  # type: ignore[arg-type]
    assert asyncio.run(adapters.ensure(other, "a1", upstream))  # type: ignore[arg-type]
    assert adapters.on(other, "a1")  # type: ignore[arg-type]
    assert adapters.loads == {("one", "a1", "loaded"): 1, ("other", "a1", "present"): 1}
