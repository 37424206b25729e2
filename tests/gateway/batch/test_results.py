"""A batch's result files: a line cut by a kill is removed and its custom_id sent again;
each result is one write."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway.batch.results import append, finished


def row(custom_id: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "response": {"status_code": 200}}) + b"\n"


def test_a_last_line_cut_by_a_kill_is_removed(tmp_path: Path) -> None:
    out, errors = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    append(out, row("a"))
    append(out, row("b"))
    out.write_bytes(out.read_bytes() + row("c")[:9])  # the kill, mid-write
    append(errors, row("x"))
    assert finished(out, errors) == ({"a", "b", "x"}, 1)
    assert out.read_bytes() == row("a") + row("b")  # ready for the next append
    append(out, row("c"))
    assert finished(out, errors) == ({"a", "b", "c", "x"}, 1)


def test_no_result_files_yet(tmp_path: Path) -> None:
    assert finished(tmp_path / "o.jsonl", tmp_path / "e.jsonl") == (set(), 0)
