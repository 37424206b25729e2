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


def apply_env(raw: dict[str, Any], environ: Mapping[str, str]) -> tuple[dict[Path, str],
                                                                        list[str]]:
    """Set each non-empty ``VGW_A__B__C`` variable at ``a.b.c`` in ``raw`` (a number picks an
    entry of a list: ``VGW_BACKENDS__0__URL``). Returns where each path came from and the
    variables that name no place."""
    origins: dict[Path, str] = {}
    problems = []
    for name in sorted(environ):
        value = environ[name]
        if not name.startswith(PREFIX) or SEP not in name or not value:
            continue
        path: Path = tuple(int(p) if p.isdigit() else p.lower()
                           for p in name[len(PREFIX):].split(SEP))
        node: Any = raw
        for i, part in enumerate(path[:-1]):
            if isinstance(part, int) and isinstance(node, list) and part < len(node):
                node = node[part]
            elif isinstance(part, str) and isinstance(node, dict):
                if part not in node:  # a table the file does not have: named by the variable
                    origins.setdefault(path[:i + 1], name)
                node = node.setdefault(part, {})
            else:
                node = None
            if not isinstance(node, dict | list):
                where = ".".join(map(str, path[:i + 1]))
                problems.append(f"{name}: {where}: no such table or entry")
                break
        else:
            last = path[-1]
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
