"""Logging for the gateway's processes (the CLI and every worker): JSON lines by default,
or plain text. A record's ``fields`` (the request log's) become keys of their own."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
from typing import Any

import orjson


class DropExpected(logging.Filter):
    """Keep uvicorn from printing tracebacks for connections dropped on purpose."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        super().__init__()
        self._kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, self._kinds)


def timestamp(created: float) -> str:
    """``2026-12-04T17:51:10.830Z``: UTC, milliseconds."""
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
            + f".{int(created * 1000) % 1000:03d}Z")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
            "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json_line(line)


# What could start a forged line or rewrite a terminal: C0 controls, DEL, C1 controls
# (ANSI's CSI among them) and Unicode's line and paragraph separators.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What JSON keeps raw inside a string but a line reader may split on (Python's splitlines
# does on NEL and the separators).
SPLITS = re.compile("[\x7f-\x9f\u2028\u2029]")
# What makes a text line's field value ambiguous unless quoted: a space or '=' would start a
# field of its own, a quote or backslash would read as quoting.
QUOTED = re.compile('[\\s"=\\\\\x00-\x1f\x7f-\x9f\u2028\u2029]')


def json_line(line: dict[str, Any]) -> str:
    text = orjson.dumps(line, default=str).decode()
    if SPLITS.search(text):  # only ever inside a string: its \uXXXX escape is the same text
        text = SPLITS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def escape(text: str) -> str:
    """``text`` on one line: every control character written as its escape (\\n, \\x1b)."""
    if not CONTROL.search(text):
        return text
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def field(text: str) -> str:
    """A field's value in a text line, logfmt's way: as it is when plain, else quoted with
    quotes and backslashes escaped, so a client's value cannot make fields of its own."""
    if text and not QUOTED.search(text):
        return text
    return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class TextFormatter(logging.Formatter):
    """One line per record: the message escaped and every field as ``field`` writes it
    (clients put values in both: a model name, a path, a user agent), then a traceback
    when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={field(str(v))}" for k, v in fields.items()
                                   if v is not None)
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class JsonLines:
    """Lines of one logger in the JSON format, written to the JSON handler's stream a loop
    turn's worth at a time: the same bytes the logging module would write, without its
    record, caller lookup, lock and flush per line (~30 µs of a request's CPU). ``of``
    gives None unless logging goes to one JSON stream handler (text format: use logging)."""

    def __init__(self, logger: str, handler: logging.StreamHandler[Any]) -> None:
        self._head = {"level": "info", "logger": logger, "pid": os.getpid()}
        self._handler = handler
        self._lines: list[str] = []
        self._second = -1
        self._stamp = ""

    @staticmethod
    def of(logger: str) -> JsonLines | None:
        handlers = logging.getLogger().handlers
        if (len(handlers) == 1 and type(handlers[0]) is logging.StreamHandler
                and isinstance(handlers[0].formatter, JsonFormatter)):
            return JsonLines(logger, handlers[0])
        return None

    def info(self, msg: str, fields: dict[str, Any]) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, timestamp(second)[:-4]
        line = {"ts": f"{self._stamp}{int(now * 1000) % 1000:03d}Z", **self._head,
                "msg": msg, **fields}
        self._lines.append(json_line(line))
        if len(self._lines) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        if not self._lines:
            return
        text = "\n".join(self._lines) + "\n"
        self._lines.clear()
        with self._handler.lock:  # type: ignore[union-attr]
            stream = self._handler.stream
            stream.write(text)
            stream.flush()


def setup(level: str, *expected: type[BaseException], fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if expected:
        logging.getLogger("uvicorn.error").addFilter(DropExpected(*expected))
