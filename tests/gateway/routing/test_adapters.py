"""Which instances of an adapter's base its requests go to (issue 41, point 2): those running
it now (vLLM's ``lora_requests_info``), then those that have it loaded, then those with a
free adapter slot, each tier only while one of its instances has room."""

from __future__ import annotations

from backends.backend import LoadReport
from gateway.config.adapters import AdapterSpec
from gateway.routing.adapters import Adapters
from tests.factories import backend

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
