"""A batch's files on disk, read and written in worker threads (never on the event loop):
the results written so far (a last line cut by a kill is removed), the lines still to
send (sorted by prompt head), one result appended in one ``write``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import orjson

from gateway.batch import lines as batch_lines
from gateway.batch.lines import Line
from gateway.routing.policies.prefix import prompt_head


def finished(out: Path, errors: Path) -> tuple[set[str], int]:
    """The custom_ids with a result written (a last line cut by a kill is removed), and
    how many of them failed; read a line at a time."""
    done: set[str] = set()
    failed = 0
    for path in (out, errors):
        before = len(done)
        try:
            with open(path, "rb+") as f:
                whole = 0
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break
                    whole += len(raw)
                    with contextlib.suppress(orjson.JSONDecodeError, LookupError, TypeError):
                        done.add(orjson.loads(raw)["custom_id"])
                if whole < f.seek(0, os.SEEK_END):
                    f.truncate(whole)
        except FileNotFoundError:
            continue
        if path is errors:
            failed = len(done) - before
    return done, failed


def todo(source: Path, done: set[str]) -> list[Line]:
    with open(source, "rb") as f:
        todo = [line for line in batch_lines.read(f) if line.custom_id not in done]
    todo.sort(key=lambda line: prompt_head(line.body, 512))
    return todo


def append(path: Path, row: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(row)
        while view:  # a short write (a full disk) is finished, or raises
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
