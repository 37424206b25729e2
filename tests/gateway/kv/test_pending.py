"""The prefill pending on each backend, added up across serving processes through one
mapped file (``gateway.kv.pending``): real processes write their rows, another reads the
sum; a restarted process's row starts empty; names beyond a row's cells take over cells
that hold nothing."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from gateway.kv.pending import REQUESTS, SLOTS, Pending, clear, create
from gateway.kv.prefill import PRIOR, Prefill


def _hold(path: str, row: int, rows: int, tokens: dict[str, int], ready, stop) -> None:  # type: ignore[no-untyped-def]
    pending = Pending(path, row)
    for name, n in tokens.items():
        pending.put(name, n, row)  # the process's number: its requests there
    ready.set()
    stop.wait(30)


def test_a_reader_adds_up_what_every_other_process_holds_pending(tmp_path: Path) -> None:
    path, rows = str(tmp_path / "pending"), 4
    create(path, rows)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    held = [{"vllm-1": 2_000, "vllm-2": 30}, {"vllm-1": 500}, {"vllm-3": 7}]
    procs, readies = [], []
    for row, tokens in enumerate(held, start=1):
        ready = ctx.Event()
        proc = ctx.Process(target=_hold, args=(path, row, rows, tokens, ready, stop))
        proc.start()
        procs.append(proc)
        readies.append(ready)
    try:
        for ready in readies:
            assert ready.wait(30)
        me = Pending(path, 0)
        me.put("vllm-1", 100, 4)
        assert me.total("vllm-1") == 2_600
        assert me.total("vllm-2") == 30
        assert me.total("vllm-3") == 7
        assert me.total("vllm-4") == 0
        assert me.total("vllm-1", REQUESTS) == 4 + 1 + 2
        assert me.total("vllm-3", REQUESTS) == 3
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
    assert all(proc.exitcode == 0 for proc in procs)


def test_a_process_that_starts_again_in_a_row_clears_what_its_predecessor_held(
        tmp_path: Path) -> None:
    path = str(tmp_path / "pending")
    create(path, 2)
    dead = Pending(path, 1)
    dead.put("vllm-1", 4_000, 2)  # then killed with those requests
    reader = Pending(path, 0)
    assert reader.total("vllm-1") == 4_000
    Pending(path, 1)  # its successor
    assert reader.total("vllm-1") == 0 and reader.total("vllm-1", REQUESTS) == 0


def test_names_past_a_rows_cells_take_over_those_holding_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "pending")
    create(path, 2)
    writer, reader = Pending(path, 0), Pending(path, 1)
    for i in range(SLOTS):
        assert writer.put(f"b{i}", i + 1, 0)
    assert not writer.put("one-more", 5, 1)  # every cell holds tokens: no room
    assert [reader.total(f"b{i}") for i in (0, 17, SLOTS - 1)] == [1, 18, SLOTS]
    writer.put("b1", 0, 1)  # no tokens, a request still in flight: kept
    for i in range(0, SLOTS, 2):
        writer.put(f"b{i}", 0, 0)  # done: these cells may be taken over
    for i in range(SLOTS // 2):
        assert writer.put(f"new{i}", 1_000 + i, 0)
    assert not writer.put("one-more", 5, 1)
    assert reader.total("b1", REQUESTS) == 1
    writer.put("b1", 2, 0)
    assert all(reader.total(f"new{i}") == 1_000 + i for i in range(SLOTS // 2))
    assert all(reader.total(f"b{i}") == i + 1 for i in range(3, SLOTS, 2))
    assert all(reader.total(f"b{i}") == 0 for i in range(0, SLOTS, 2))
    writer.put("b1", 9, 0)  # a name that kept its cell writes there still
    assert reader.total("b1") == 9


def test_a_row_past_the_maps_rows_is_refused_and_a_row_cleared_reads_nothing(
        tmp_path: Path) -> None:
    """The rows are the file's (the control process sized it for its workers): a worker
    whose config says more workers gets no row past them. The control process clears a
    dead worker's row before its successor starts (which may never open the map)."""
    path = str(tmp_path / "pending")
    create(path, 2)
    with pytest.raises(ValueError):
        Pending(path, 2)
    dead, reader = Pending(path, 1), Pending(path, 0)
    dead.put("vllm-1", 300, 2)
    assert reader.total("vllm-1") == 300
    clear(path, 1)
    assert reader.total("vllm-1") == 0 and reader.total("vllm-1", REQUESTS) == 0


def test_prefill_waits_count_every_processs_pending_tokens_not_its_own_times_n(
        tmp_path: Path) -> None:
    """With 4 processes, one 2,000-token miss pending in one of them is 2,000 tokens ahead
    for all, not 8,000 (its own times 4), and nothing is ahead where none is pending."""
    path = str(tmp_path / "pending")
    create(path, 4)
    mine, other = (Prefill(4, Pending(path, row)) for row in (0, 1))
    assert other.start("warm", 2_000) == 0
    assert mine.ahead("warm") == 2_000 and other.ahead("warm") == 2_000
    assert mine.wait("warm", 100) == pytest.approx(2_100 / PRIOR)
    assert mine.start("warm", 50) == 2_000  # what was ahead of its own, every process's
    assert mine.ahead("cold") == 0
    other.done("warm", 2_000)
    assert mine.ahead("warm") == 50
    mine.done("warm", 50)
    assert other.ahead("warm") == 0


def test_the_other_processes_requests_in_flight_and_none_without_the_map(
        tmp_path: Path) -> None:
    path = str(tmp_path / "pending")
    create(path, 2)
    mine, other = (Prefill(2, Pending(path, row)) for row in (0, 1))
    for _ in range(3):
        other.entered("vllm-1")
    mine.entered("vllm-1")
    assert mine.others("vllm-1") == 3 and other.others("vllm-1") == 1
    other.left("vllm-1")
    mine.left("vllm-1")
    mine.left("vllm-1")  # more than it sent (a restart): none, not fewer
    assert mine.others("vllm-1") == 2 and other.others("vllm-1") == 0
    assert Prefill(2).others("vllm-1") == 0  # only Backend.in_flight is known


def test_a_backend_the_row_has_no_room_for_is_counted_by_its_own_process(
        tmp_path: Path) -> None:
    path = str(tmp_path / "pending")
    create(path, 2)
    prefill = Prefill(2, Pending(path, 0))
    for i in range(SLOTS):
        prefill.entered(f"b{i}")  # every cell holds a request
    prefill.start("late", 700)
    assert prefill.unshared == {"late"}
    assert prefill.ahead("late") == 700 and prefill.others("late") == 0
    prefill.left("b0")  # a cell holds nothing now: the next change takes it
    prefill.done("late", 200)
    assert prefill.unshared == set() and prefill.ahead("late") == 500
