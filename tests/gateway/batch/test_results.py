"""A batch's result files: a line cut by a kill is removed and its custom_id sent again;
each result is one write."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway.batch.results import append, finished, load, todo


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


def test_the_lines_left_are_kept_by_place_and_read_again_in_prompt_order(
        tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"

    def line(custom_id: str, system: str) -> bytes:
        return orjson.dumps({"custom_id": custom_id, "method": "POST",
                             "url": "/v1/chat/completions", "body": {"messages": [
                                 {"role": "system", "content": system},
                                 {"role": "user", "content": custom_id}]}}) + b"\n"
    source.write_bytes(line("a", "zeta") + line("b", "alpha") + b"\n" + line("c", "zeta")
                       + line("d", "alpha"))
    left = todo(source, {"d"})
    assert [load(source, item).custom_id for item in left] == ["b", "a", "c"]
    assert all(len(item.head) <= 128 for item in left)
