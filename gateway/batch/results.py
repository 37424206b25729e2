"""A batch's files on disk, read and written in worker threads (never on the event loop):
the results written so far (a last line cut by a kill is removed), the lines still to
send (their places in the input, sorted by prompt head) and each one read again when it
is sent, one result appended in one ``write``."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Todo:
    """A line still to send, by where it is in the input file (its body is read again
    when it is sent, so a batch's lines are not all held in memory)."""

    offset: int
    size: int
    head: bytes  # the start of its prompt: lines that share it are sent together


HEAD = 128  # characters of a prompt's start that order the lines


def todo(source: Path, done: set[str]) -> list[Todo]:
    """The lines of ``source`` without a result, ordered by the start of their prompt."""
    out: list[Todo] = []
    with open(source, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            if raw.strip():
                line = batch_lines.parse(number, raw)
                if line.custom_id not in done:
                    out.append(Todo(offset, len(raw), prompt_head(line.body, HEAD)))
            offset += len(raw)
    out.sort(key=lambda item: item.head)
    return out


def load(source: Path, item: Todo) -> Line:
    """The line ``item`` stands for, read again from ``source``."""
    with open(source, "rb") as f:
        f.seek(item.offset)
        return batch_lines.parse(0, f.read(item.size))


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
