"""Where a config value came from: overrides from the environment (``VGW_SECTION__KEY``),
and the file line of each key, so that a problem reads ``config.toml:42: backends.1.url: ...``
(as ``nginx -t`` does).

tomllib keeps no positions and tomlkit none that are public, so the lines come from a scan
of the text that follows tables and keys; it only locates, the values are tomllib's."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from typing import Any

PREFIX = "VGW_"
SEP = "__"
_HEADER = re.compile(r"\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_NAME = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_KEY = re.compile(rf"\s*({_NAME}(?:\s*\.\s*{_NAME})*)\s*=")
Path = tuple[str | int, ...]


def _parts(dotted: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(r"""[^."']+|"[^"]*"|'[^']*'""",
                                                        dotted) if p.strip()]


def _value(text: str) -> Any:
    """An array or inline table is read as TOML; anything else stays a string, which the
    config's own types convert (``"8"`` to a number, ``"true"`` to a boolean)."""
    if text[:1] in "[{":
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            pass
    return text


FREE_FORM = frozenset(("env", "groups"))  # tables whose keys are the user's (case kept)


def _key(node: dict[str, Any], part: str, parent: str | int | None) -> str:
    """The key a variable's name part stands for: the file's own spelling when a key
    matches whatever its case, else the part as written in a free-form table (a spawn's
    ``env``, a model's ``groups``), else in lower case (every key of ours is)."""
    folded = part.lower()
    for key in node:
        if isinstance(key, str) and key.lower() == folded:
            return key
    return part if parent in FREE_FORM else folded


def _part(node: Any, word: str, path: Path) -> str | int:
    """One word of a variable's name as a step into ``node``: an index or a key."""
    if word.isdigit():
        return int(word)
    return _key(node, word, path[-1] if path else None) if isinstance(node, dict) else word


def _descend(node: Any, path: Path, name: str, origins: dict[Path, str]) -> Any:
    """The table or entry at the last step of ``path`` (a table the file lacks is made and
    named by the variable), or None when there is none."""
    part = path[-1]
    if isinstance(part, int) and isinstance(node, list) and part < len(node):
        found = node[part]
    elif isinstance(part, str) and isinstance(node, dict):
        if part not in node:
            origins.setdefault(path, name)
        found = node.setdefault(part, {})
    else:
        return None
    return found if isinstance(found, dict | list) else None


def _mistyped(name: str, sections: frozenset[str]) -> str | None:
    """A ``VGW_`` variable with no ``__`` whose first word names a section: a setting
    written with one underscore (``VGW_REDIS_URL``), which would otherwise do nothing."""
    head, _, rest = name[len(PREFIX):].partition("_")
    if SEP in name or not rest or head.lower() not in sections:
        return None
    return (f"{name}: not a setting: a section and its key are joined by two underscores "
            f"({PREFIX}{head}{SEP}{rest})")


def apply_env(raw: dict[str, Any], environ: Mapping[str, str],
              sections: frozenset[str] = frozenset()) -> tuple[dict[Path, str], list[str]]:
    """Set each non-empty ``VGW_A__B__C`` variable at ``a.b.c`` in ``raw`` (a number picks an
    entry of a list: ``VGW_BACKENDS__0__URL``). Returns where each path came from and the
    variables that name no place (or are settings mistyped with one underscore between a
    section, one of ``sections``, and its key)."""
    origins: dict[Path, str] = {}
    problems = []
    for name in sorted(environ):
        value = environ[name]
        if not name.startswith(PREFIX) or not value:
            continue
        if SEP not in name:
            if (mistyped := _mistyped(name, sections)) is not None:
                problems.append(mistyped)
            continue
        node: Any = raw
        path: Path = ()
        *tables, leaf = name[len(PREFIX):].split(SEP)
        for word in tables:
            path += (_part(node, word, path),)
            node = _descend(node, path, name, origins)
            if node is None:
                problems.append(f"{name}: {'.'.join(map(str, path))}: no such table or entry")
                break
        else:
            last = _part(node, leaf, path)
            path += (last,)
            if isinstance(node, dict) and isinstance(last, str):
                node[last] = _value(value)
                origins[path] = name
            else:
                problems.append(f"{name}: {'.'.join(map(str, path))}: no such key")
    return origins, problems


def _lines(text: str) -> dict[Path, int]:
    """The line (1-based) of every table header and key in a TOML text."""
    found: dict[Path, int] = {}
    counts: dict[Path, int] = {}
    table: Path = ()
    quote: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if quote is not None:  # inside a multi-line string
            if line.count(quote) % 2:
                quote = None
            continue
        header = _HEADER.match(line)
        if header:
            table = _table(header.group(1) == "[[", _parts(header.group(2)), counts)
            found.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            found.setdefault(table + tuple(_parts(key.group(1))), number)
            for mark in ('"""', "'''"):
                if line.count(mark) % 2:
                    quote = mark
    return found


def _table(array: bool, parts: list[str], counts: dict[Path, int]) -> Path:
    """The path of a ``[a.b]`` or ``[[a.b]]`` header; a name under an array of tables means
    its latest entry (``[backends.spawn]`` after the second ``[[backends]]``)."""
    path: Path = ()
    for i, part in enumerate(parts):
        path += (part,)
        last = i == len(parts) - 1
        if path in counts and not (last and array):
            path += (counts[path] - 1,)
    if array:
        counts[path] = counts.get(path, 0) + 1
        path += (counts[path] - 1,)
    return path


class Where:
    """Prefixes each ``dotted.key: message`` problem with where that key was set."""

    def __init__(self, file: str, text: str, origins: dict[Path, str]) -> None:
        self._file = file
        self._lines = _lines(text)
        self._origins = origins

    def __call__(self, problem: str) -> str:
        dotted, sep, _ = problem.partition(": ")
        if not sep or " " in dotted:
            return f"{self._file}: {problem}"
        path: Path = tuple(int(p) if p.isdigit() else p for p in dotted.split("."))
        for end in range(len(path), 0, -1):
            if path[:end] in self._origins:
                return f"{self._origins[path[:end]]}: {problem}"
            if path[:end] in self._lines:
                return f"{self._file}:{self._lines[path[:end]]}: {problem}"
        return f"{self._file}: {problem}"
