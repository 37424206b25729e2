"""Logging for the gateway's processes (the CLI and every worker): JSON lines by default,
or plain text. A record's ``fields`` (the request log's) become keys of their own."""

from __future__ import annotations

import logging
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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
            "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


# What could start a forged line or rewrite a terminal: C0 controls, DEL, C1 controls
# (ANSI's CSI among them) and Unicode's line and paragraph separators.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """``text`` on one line: every control character written as its escape (\\n, \\x1b)."""
    if not CONTROL.search(text):
        return text
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    """One line per record: the message and every field escaped (clients put values in
    both: a model name, a path), then a traceback when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={escape(str(v))}" for k, v in fields.items()
                                   if v is not None)
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(level: str, *expected: type[BaseException], fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if expected:
        logging.getLogger("uvicorn.error").addFilter(DropExpected(*expected))
