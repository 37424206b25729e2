"""GPU memory for a wake or a start (``gateway.control.room``): which awake instances go to
sleep (or stop) first so that another fits on its GPU, least recently used first, never
one with requests in flight or one that cannot sleep or stop."""

from __future__ import annotations

from typing import Any

from backends.backend import Backend, GpuReading, LoadReport
from gateway.control.room import to_make_room
from tests.factories import backend

GB = 1 << 30


def on_gpu(name: str, share: float = 0.45, **spawn: Any) -> Backend:
    b = backend(name, spawn={"model": name, "port": 9, "gpus": [0], "command": ["x"],
                             "args": ["--gpu-memory-utilization", str(share)], **spawn})
    b.mark_ready()
    return b


def read(b: Backend, used: float, total: float = 80) -> None:
    b.load = LoadReport(gpus=(GpuReading(0, int(used * GB), int(total * GB), 40),))


def test_the_least_recently_used_idle_instance_makes_room() -> None:
    old, recent = on_gpu("old", sleep_after=60), on_gpu("recent", sleep_after=60)
    wanted = on_gpu("wanted", sleep_after=60)
    wanted.fall_asleep(1)
    read(old, used=72)  # two awake at 0.45 of 80 GB: 8 GB free, the wanted one needs 36
    last = {"old": 10.0, "recent": 20.0}
    assert to_make_room([old, recent, wanted], wanted, lambda b: last[b.name]) == [old]
    read(old, used=30)  # it fits
    assert to_make_room([old, recent, wanted], wanted, lambda b: last[b.name]) == []


def test_busy_instances_and_those_that_never_sleep_or_stop_stay() -> None:
    busy, fixed = on_gpu("busy", stop_after=60), on_gpu("fixed")
    busy.in_flight = 1
    idle, wanted = on_gpu("idle", sleep_after=60), on_gpu("wanted", start="on_demand")
    wanted.stop()
    read(busy, used=79)
    assert to_make_room([busy, fixed, idle, wanted], wanted, lambda b: 0.0) == [idle]


def test_nothing_is_done_without_a_reading() -> None:
    idle, wanted = on_gpu("idle", sleep_after=60), on_gpu("wanted", sleep_after=60)
    assert to_make_room([idle, wanted], wanted, lambda b: 0.0) == []
